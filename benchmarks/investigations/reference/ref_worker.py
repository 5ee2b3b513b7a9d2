"""Long-lived worker that runs the reference DSBD implementation (ZongyueQin/DSBD) on request.

Runs in the reference's own virtual environment (transformers 4.35.2, see README.md here), never
in ours, and imports the reference's code from its checkout (`--ref-dir`); nothing of it is
copied into this repository. The driver (`side_by_side.py` beside this file, our venv) sends
one JSON request per line on stdin and reads one JSON reply per line on the protocol pipe.

Why a wrapper and not an edit of the reference:
- Loading. The reference loads models with its patched `LlamaForCausalLM.from_pretrained` (the
  only class whose forward accepts the forest mask). Our converted checkpoints are written by
  transformers 5, whose `config.json` keeps the RoPE base under `rope_parameters`; 4.35 would
  silently fall back to rope_theta=10000. So we write a 4.35-style config next to a symlink of
  the same `model.safetensors` and call the same `from_pretrained`.
- Qwen2. The reference has no Qwen2 model file and pins transformers 4.35.2 (< 4.37, the first
  release with Qwen2). Qwen2 is Llama plus biases on q/k/v; we load it into the reference's
  patched Llama class and replace q/k/v_proj by biased Linear layers holding the checkpoint's
  weights and biases (exact: the driver checks logits against our transformers-5 model).
- Counting. Forward passes are counted with forward hooks on the two models; the reference's
  own counters (details=True) are returned next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def legacy_llama_config(source: Path) -> tuple[dict, bool]:
    """A transformers-4.35 LlamaConfig dict for our checkpoint, and whether it needs qkv biases."""
    cfg = json.loads((source / "config.json").read_text())
    if cfg["model_type"] not in ("llama", "qwen2"):
        raise SystemExit(f"{source}: model_type={cfg['model_type']!r}; allowed: llama, qwen2")
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if head_dim * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise SystemExit(f"{source}: head_dim {head_dim} != hidden/heads (4.35 Llama needs it)")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"{source}: rope_type={rope.get('rope_type')!r} is not supported")
    legacy = {key: cfg[key] for key in _CONFIG_KEYS if key in cfg}
    legacy.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=None,
        attention_bias=False,
        torch_dtype="float32",
    )
    return legacy, cfg["model_type"] == "qwen2"


def load_reference_model(source: Path, workdir: Path) -> torch.nn.Module:
    """Our float32 checkpoint in the reference's patched Llama class (Qwen2: + q/k/v biases)."""
    from safetensors import safe_open
    from sampling.models.modeling_llama import LlamaForCausalLM

    legacy, qkv_bias = legacy_llama_config(source)
    out = workdir / source.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(legacy, indent=1))
    link = out / "model.safetensors"
    if not link.exists():
        link.symlink_to(source / "model.safetensors")
    # low_cpu_mem_usage (needs accelerate) loads the weights once instead of into a randomly
    # initialised copy: ~6 GB instead of ~12 GB peak for the 1.5B Qwen target in float32.
    model = LlamaForCausalLM.from_pretrained(
        str(out), torch_dtype=torch.float32, low_cpu_mem_usage=True
    )
    if qkv_bias:
        with safe_open(str(source / "model.safetensors"), framework="pt") as weights:
            for index, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(attn, name)
                    new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
                    prefix = f"model.layers.{index}.self_attn.{name}"
                    new.weight.data = weights.get_tensor(f"{prefix}.weight").float()
                    new.bias.data = weights.get_tensor(f"{prefix}.bias").float()
                    setattr(attn, name, new)
    return model.eval()


class CallCounter:
    """Forward calls of a module and the peak KV-cache bytes its outputs hold (a forward hook,
    no edit of the counted code; the same figures dsbd.bench.decode.measure takes for ours)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self.kv_peak_bytes = 0
        self.kv_peak_shape = (0, 0)
        module.register_forward_hook(self._hook)

    def reset(self) -> None:
        self.calls, self.kv_peak_bytes, self.kv_peak_shape = 0, 0, (0, 0)

    def _hook(self, module, args, output) -> None:
        self.calls += 1
        rows = columns = size = 0
        for layer in getattr(output, "past_key_values", None) or ():  # legacy (k, v) tuples
            for tensor in layer[:2]:
                size += tensor.numel() * tensor.element_size()
                rows, columns = max(rows, tensor.shape[0]), max(columns, tensor.shape[2])
        if size > self.kv_peak_bytes:
            self.kv_peak_bytes, self.kv_peak_shape = size, (rows, columns)


class RssSampler:
    """Peak resident memory of this process during a block, sampled every 10 ms."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self.baseline = self.peak = self._rss()

    def _rss(self) -> int:
        with open("/proc/self/statm") as stream:
            return int(stream.read().split()[1]) * self._page

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())


def call_reference(method: str, prefix: torch.Tensor, cfg: dict, target, draft):
    """The reference's own entry point for `method`: (output ids [1, L], its details or {})."""
    from sampling import (
        autoregressive_sampling,
        beam_speculative_sampling,
        random_width_beam_sampling,
        speculative_sampling,
    )

    top_p = cfg["top_p"] if cfg["top_p"] < 1.0 else 0.0  # the reference disables top-p with 0
    if method == "dsbd":
        return beam_speculative_sampling(
            prefix,
            draft,
            target,
            eos_token_id=cfg["eos_token_id"],
            pad_token_id=cfg["pad_token_id"],
            max_len=cfg["max_new_tokens"],
            gamma=cfg["gamma"],
            width=cfg["width"],
            num_beams=cfg["width"],
            min_num_beams=cfg["w_min"],
            extra_sample_cnt=1 if cfg["lean_memory"] else -1,
            # threshold None (fixed width W): t = 0 makes get_expect_cnt_by_thres return W
            expect_thres=0.0 if cfg["threshold"] is None else cfg["threshold"],
            temperature=cfg["temperature"],
            top_k=cfg["top_k"],
            top_p=top_p,
            details=True,
        )
    elif method == "sps":
        return speculative_sampling(
            prefix,
            draft,
            target,
            eos_token_id=cfg["eos_token_id"],
            pad_token_id=cfg["pad_token_id"],
            max_len=cfg["max_new_tokens"],
            gamma=cfg["gamma"],
            temperature=cfg["temperature"],
            top_k=cfg["top_k"],
            top_p=top_p,
            random_seed=None,
            details=True,  # a seed here would reseed before every uniform
        )
    elif method == "beam":
        return random_width_beam_sampling(
            prefix,
            target,
            cfg["max_new_tokens"],
            eos_token_id=cfg["eos_token_id"],
            max_num_beams=cfg["width"],
            min_num_beams=cfg["width"],
            temperature=cfg["temperature"],
            top_k=cfg["top_k"],
            top_p=top_p,
            pad_token_id=cfg["pad_token_id"],
        )
    elif method == "sample":
        return autoregressive_sampling(
            prefix,
            target,
            cfg["max_new_tokens"],
            eos_token_id=cfg["eos_token_id"],
            temperature=cfg["temperature"],
            top_k=cfg["top_k"],
            top_p=top_p,
            pad_token_id=cfg["pad_token_id"],
        )
    else:
        raise ValueError(f"method={method!r}: allowed dsbd, sps, beam, sample")


def run_decode(request: dict, target, draft, counters: dict[str, CallCounter]) -> dict:
    """One reference decode: wall and CPU time and RSS of the call only, hooks count forwards."""
    prefix = torch.tensor([request["prompt_ids"]], dtype=torch.long)
    torch.manual_seed(request["seed"])
    for counter in counters.values():
        counter.reset()
    with RssSampler() as rss:
        cpu, start = time.process_time(), time.perf_counter()
        output = call_reference(request["method"], prefix, request["config"], target, draft)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    output, details = output if isinstance(output, tuple) else (output, {})
    answer = output[0, prefix.shape[1] :].tolist()
    reply = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "rss_peak_delta_bytes": max(0, rss.peak - rss.baseline),
        "answer_ids": answer,
        "target_calls": counters["target"].calls,
        "draft_calls": counters["draft"].calls,
        "target_kv_peak_bytes": counters["target"].kv_peak_bytes,
        "target_kv_peak_shape": counters["target"].kv_peak_shape,
        "draft_kv_peak_bytes": counters["draft"].kv_peak_bytes,
    }
    if details:
        acc_len = [int(a) for a in details["acc_len"]]
        reply.update(
            accepted_layers=acc_len,
            # each iteration keeps its accepted layers (tokens) and appends one token
            steps=sum(acc_len) + len(acc_len),
            ref_target_call_times=int(details["target_call_times"]),
            ref_approx_call_times=int(details["approx_call_times"]),
        )
        if "expect_cnt_list" in details:  # DSBD: the width chosen for every verified layer
            reply["widths"] = [int(w) for w in details["expect_cnt_list"]]
    elif request["method"] == "beam":
        reply["steps"] = counters["target"].calls  # one target call per step, prefill included
    else:
        reply["steps"] = len(answer)
    return reply


@torch.no_grad()
def top_logprobs(ids: list[int], k: int, target, draft) -> dict:
    """Top-k next-token log-probabilities at every position (parity check against our models)."""
    reply = {}
    for name, model in (("target", target), ("draft", draft)):
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        top = logp.topk(k, dim=-1)
        reply[name] = {"indices": top.indices.tolist(), "values": top.values.tolist()}
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref-dir", required=True, help="checkout of ZongyueQin/DSBD")
    parser.add_argument("--target", required=True, help="our float32 checkpoint directory")
    parser.add_argument("--draft", required=True, help="our float32 checkpoint directory")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    # The protocol gets its own copy of stdout; everything printed (by the reference, by
    # transformers) goes to stderr so it cannot corrupt a reply.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.path.insert(0, str(Path(args.ref_dir).resolve()))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="dsbd-ref-") as workdir:
        target = load_reference_model(Path(args.target), Path(workdir) / "target")
        draft = load_reference_model(Path(args.draft), Path(workdir) / "draft")
    counters = {"target": CallCounter(target), "draft": CallCounter(draft)}
    import transformers

    hello = {
        "ready": True,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nice": os.nice(0),
        "threads": torch.get_num_threads(),
    }
    protocol.write(json.dumps(hello) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "logprobs":
                reply = top_logprobs(request["ids"], request.get("k", 20), target, draft)
            elif request["op"] == "decode":
                with torch.no_grad():
                    reply = run_decode(request, target, draft, counters)
            else:
                reply = {"error": f"op={request['op']!r}: allowed logprobs, decode"}
        # the reference raises on some inputs (ALGORITHM.md §9.3 item 14)
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        protocol.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
