"""Engine adapters: vLLM (an offloading spec, and NIXL's connector on datamover) and SGLang (a HiCache storage).

Each engine loads its adapter by module path, so nothing here is imported until an engine asks for it:
`datamover.integrations.vllm` needs vLLM, `datamover.integrations.sglang` needs SGLang. Both keep their chunks in a
`TieredCache` built by `datamover.integrations.tiers` from the engine's `kv_cache_tiered` section.
"""
