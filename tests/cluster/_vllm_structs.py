"""The msgspec structs vLLM decodes KV-event batches with (array_like, tagged), written from the
shapes documented in vllm/distributed/kv_events.py: the current layout and the first one (no
medium, no rank). Needs msgspec. (No ``from __future__ import annotations``: msgspec resolves
the field types at run time.)"""

from typing import Any

import msgspec


class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class FirstBlockStored(Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class FirstBlockRemoved(Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]


class FirstKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[FirstBlockStored | FirstBlockRemoved | AllBlocksCleared]
