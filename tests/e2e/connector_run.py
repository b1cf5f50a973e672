"""Run the real vLLM (in-process engine) with KVPoolConnector, as a fresh process for e2e tests.

    python tests/e2e/connector_run.py SPEC.json OUT.json

SPEC: {"model_dir", "master" (or null: no connector), "extra_config", "multi_example_dir" (wrap in
MultiConnector after ExampleConnector writing there), "block_size", "max_num_batched_tokens",
"dtype", "logprobs", "phases": [{"prompts": [[ids]], "max_tokens", "reset_prefix_cache",
"corrupt_prompt": [ids] (overwrite that prompt's pooled objects with random bytes first),
"flip_prompt": [ids] (flip one bit inside each of that prompt's objects in the node's memory, under
the checksum the writer stored),
"wait_file" (wait for it before the phase), "signal_file" (create it after the phase),
"continue_with": [ids] (the prompt is the previous phase's first prompt + its output + these ids: the
next turn of an agent's session), "group" (a hybrid model's KV-cache group whose objects corrupt_prompt
/ flip_prompt change; the others stay intact)}],
"tensor_parallel_size" (> 1: vLLM's multiprocess executor, one worker process per rank),
"llm_kwargs" (more vllm.LLM arguments), "enforce_eager" (default true: torch.compile costs ~27 s more per fresh process here, warm caches
and all; the tests that need the compiled model say false)}
OUT: per phase, per prompt {"token_ids", "logprobs"}; plus metric counters after each phase.
Prefix-cache resets between phases make a phase see only the pool, like a fresh process would.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def _kv_transfer_config(spec: dict) -> dict | None:
    if spec.get("master") is None:
        return None
    ours = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.connector",
        "kv_connector_extra_config": {"master_address": spec["master"], **spec.get("extra_config", {})},
    }
    if spec.get("multi_example_dir"):
        example = {"kv_connector": "ExampleConnector",
                   "kv_connector_extra_config": {"shared_storage_path": spec["multi_example_dir"]}}
        children = [ours, example] if spec.get("multi_pool_first", True) else [example, ours]
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"connectors": [{**c, "kv_role": "kv_both"} for c in children]}}
    return {**ours, "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


def _counters(llm) -> dict[str, float]:
    wanted = ("vllm:external_prefix_cache", "vllm:prefix_cache", "vllm:kvpool_")
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(wanted) and hasattr(metric, "value"):
            out[metric.name] = out.get(metric.name, 0) + float(metric.value)
    return out


_LLM = None  # the run's vllm.LLM


def _our_connector(spec: dict):
    """The worker's KVPoolConnector (in this process when TP == 1), else the scheduler's."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if spec.get("master") is None:
        return None
    if has_kv_transfer_group():
        connector = get_kv_transfer_group()
    else:  # TP > 1: the workers are other processes; the in-process engine core has the scheduler's
        connector = _LLM.llm_engine.engine_core.engine_core.scheduler.connector
    return next(c for c in getattr(connector, "_connectors", [connector]) if type(c).__name__ == "KVPoolConnector")


def _drain_saves(spec: dict, prompts: list[list[int]]) -> None:
    ours = _our_connector(spec)
    if ours is None:
        return
    if ours._worker is not None:
        if not ours._worker.drain(30.0):
            raise RuntimeError("pool saves did not finish within 30 s")
        return
    from kvpool.client import Client  # TP > 1: wait until every rank's objects are in the pool

    rules = ours._group_rules  # a hybrid model: wait for its first full-attention group's blocks
    full = next((g for g, rule in (rules or {}).items() if rule.kind == "full"), None)
    keys = [k for p in prompts for k in (_full_group_keys(spec, p, full) if rules else _object_keys(spec, p))]
    deadline = time.monotonic() + 60
    for namespace in ours.rank_namespaces:
        with Client(spec["master"], namespace) as client:
            while keys and not all(client.exists(keys)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"saves of rank namespace {namespace} did not land within 60 s")
                time.sleep(0.1)


def _settle_late_saves(spec: dict, timeout_s: float = 30.0) -> None:
    """Saves planned when a request finished reach the worker with the next step's metadata: step
    the engine until the scheduler holds no block for a save (TP == 1: the worker is here)."""
    ours = _our_connector(spec)
    if ours is None or ours._worker is None:
        return
    scheduler = _LLM.llm_engine.engine_core.engine_core.scheduler.connector
    scheduler = next(c for c in getattr(scheduler, "_connectors", [scheduler]) if type(c).__name__ == "KVPoolConnector")
    deadline = time.monotonic() + timeout_s
    while scheduler.has_pending_push_work():
        if time.monotonic() > deadline:
            raise RuntimeError(f"saves still hold blocks after {timeout_s} s")
        _LLM.llm_engine.step()
        ours._worker.drain(timeout_s)


def _object_keys(spec: dict, prompt: list[int], group: int | None = None) -> list[str]:
    """The prompt's object keys; for a hybrid model, those of `group` that the pool holds."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    from kvpool.client import Client
    from kvpool.connector.groups import group_block_key

    ours = _our_connector(spec)
    init_none_hash(sha256)
    bs, parent, hashes = spec["block_size"], None, []
    for start in range(0, len(prompt) - bs + 1, bs):
        parent = hash_block_tokens(sha256, parent, prompt[start : start + bs], None)
        hashes.append(parent)
    if group is None:
        k = ours.geom.blocks_per_object
        return [h.hex() for h in hashes[k - 1 :: k]]
    keys = [group_block_key(group, h) for h in hashes]
    with Client(spec["master"], ours.namespace) as client:
        return [key for key, held in zip(keys, client.exists(keys)) if held]


def _full_group_keys(spec: dict, prompt: list[int], group: int) -> list[str]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    from kvpool.connector.groups import group_block_key

    init_none_hash(sha256)
    bs, parent, keys = spec["block_size"], None, []
    for start in range(0, len(prompt) - bs + 1, bs):
        parent = hash_block_tokens(sha256, parent, prompt[start : start + bs], None)
        keys.append(group_block_key(group, parent))
    return keys


def _group_layout(spec: dict, group: int | None):
    worker = _our_connector(spec)._worker
    return worker._layout if group is None else worker._group_layouts[group]


def _flip(spec: dict, prompt: list[int], group: int | None = None) -> int:
    """Flip one bit in the middle of each of `prompt`'s objects, in the segment itself."""
    import ctypes

    from kvpool.client import Client
    from kvpool.transfer.shm import PeerMapping

    ours = _our_connector(spec)
    keys = _object_keys(spec, prompt, group)
    with Client(spec["master"], ours.namespace) as client:
        _, reply, replicas = client._lookup_leased(keys)
        client._release(reply.lease_id)
        for rs in replicas:
            (replica,) = rs
            info = client._segments.get({replica.segment_id})[replica.segment_id]
            mapping = PeerMapping(info.shm_path, info.size_bytes, info.agent_name)
            try:
                byte = ctypes.c_uint8.from_address(mapping.base_addr + replica.offset + replica.size // 2)
                byte.value ^= 0x04
            finally:
                mapping.close()
    return len(replicas)


def _corrupt(spec: dict, prompt: list[int], group: int | None = None) -> int:
    """Overwrite the pool objects of `prompt`'s full blocks with random bytes of the same size."""
    import numpy as np

    from kvpool.client import Client

    ours = _our_connector(spec)
    keys = _object_keys(spec, prompt, group)
    size = _group_layout(spec, group).block_bytes * ours.geom.blocks_per_object
    rng = np.random.default_rng(0)
    with Client(spec["master"], ours.namespace) as client:
        client.remove(keys)
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else None
            if group is not None:  # as the connector writes a hybrid model's blocks (groups.py)
                full = next(g for g, rule in sorted(ours._group_rules.items()) if rule.kind == "full")
                parent = f"g{full}-{key.split('-', 1)[1]}"
            client.put(key, rng.standard_normal(size // 4).astype(np.float32).tobytes(), parent)
    return len(keys)


def main(spec_path: str, out_path: str) -> int:
    global _LLM
    from vllm import LLM, SamplingParams

    spec = json.loads(open(spec_path).read())
    parallel = {}
    if spec.get("tensor_parallel_size", 1) > 1:
        parallel = {"tensor_parallel_size": spec["tensor_parallel_size"], "distributed_executor_backend": "mp"}
    _LLM = llm = LLM(
        model=spec["model_dir"], skip_tokenizer_init=True, load_format="safetensors",
        dtype=spec.get("dtype", "float32"), block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 64 << 20),
        max_model_len=spec.get("max_model_len", 4096),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        enable_prefix_caching=True, disable_log_stats=False, seed=0,
        prefix_caching_hash_algo=spec.get("prefix_caching_hash_algo", "sha256"),
        kv_transfer_config=_kv_transfer_config(spec), enforce_eager=spec.get("enforce_eager", True), **parallel,
        **spec.get("llm_kwargs", {}),
    )
    result = {"phases": []}
    if spec.get("wait_embedded_node_s"):
        ours = _our_connector(spec)
        if not ours._node.wait_mounted(spec["wait_embedded_node_s"]):
            raise TimeoutError("the embedded node did not mount")
    for phase in spec["phases"]:
        if phase.get("wait_file"):  # the test changes the world (restarts the master...) meanwhile
            deadline = time.monotonic() + 300
            while not os.path.exists(phase["wait_file"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{phase['wait_file']} did not appear")
                time.sleep(0.05)
        if phase.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        if phase.get("continue_with") is not None:
            previous = result["phases"][-1]
            phase["prompts"] = [previous["prompts"][0] + previous["outputs"][0]["token_ids"] + phase["continue_with"]]
        group = phase.get("group")
        if isinstance(group, str):  # a kind: the first group that keeps it
            rules = _our_connector(spec)._group_rules
            group = next(g for g, rule in sorted(rules.items()) if rule.kind == group)
        corrupted = _corrupt(spec, phase["corrupt_prompt"], group) if phase.get("corrupt_prompt") else 0
        if phase.get("flip_prompt"):
            corrupted = _flip(spec, phase["flip_prompt"], group)
        params = SamplingParams(max_tokens=phase.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                                logprobs=spec.get("logprobs", 1))
        outputs = []
        for prompt in phase["prompts"]:
            started = time.perf_counter()
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            completion = out.outputs[0]
            outputs.append({
                "token_ids": list(completion.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(completion.logprobs or [], completion.token_ids)],
                "num_cached_tokens": out.num_cached_tokens,
                "latency_s": time.perf_counter() - started,
            })
        _drain_saves(spec, phase["prompts"])  # background saves must land before the next phase looks them up
        for _ in range(3):  # engine steps deliver the worker's completions and stats to the scheduler
            llm.llm_engine.step()
        _settle_late_saves(spec)
        result["phases"].append({"outputs": outputs, "counters": _counters(llm), "corrupted_objects": corrupted,
                                 "prompts": phase["prompts"]})
        if phase.get("signal_file"):
            open(phase["signal_file"], "w").close()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
