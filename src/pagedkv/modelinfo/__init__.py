"""Model shapes, torch-free: the keys of a Hugging Face ``config.json`` or a GGUF header parsed
once into a :class:`~pagedkv.modelinfo.shape.ModelShape` (layers, heads, sliding windows, MoE and
MLA parameter counts, weight bytes). The planner sizes from it without a model or torch; the
model loader builds its config on it. It sits above the KV core (it names the core's attention
specs per layer) and below the model and the planner. :mod:`.naming` has the name a model is
served under (from its path)."""
