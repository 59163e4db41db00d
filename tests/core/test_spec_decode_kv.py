

def test_slots_stop_at_max_model_len_so_the_scheduler_cuts_the_drafts():
    """Found by the fast-vs-general machine: drafts reach max_model_len fast. The slot count is
    capped there, so a step that schedules past it gets fewer slots than tokens; the scheduler
    must cut ``k`` to ``max_model_len - num_computed_tokens - 1`` first."""
    kv = KVCacheManager(10, block_size=BLOCK_SIZE, hash_seed=0, max_model_len=12)
    request = start(kv)  # c = 6, 7 tokens
    blocks = kv.allocate_slots(request, 1 + 8)  # 15 slots asked, 12 given: 3 blocks, not 4
    assert blocks.get_block_ids() == ([3],)
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    k = 12 - request.num_computed_tokens - 1  # 5 drafts fit
    assert kv.allocate_slots(request, 1 + k).get_block_ids() == ([],)
    request.num_computed_tokens += 1 + k
    check_invariants(kv, [request])
