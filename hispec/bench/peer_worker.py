"""One peer engine in its own process, driven by ``hispec bench`` through JSON lines.

Runs under the peer's own Python (its own venv), so it imports nothing but the standard
library at the top and the engine when it loads; hispec itself is imported only by the
``hispec`` engine (hispec on other weights, in the benchmark's Python).

    python peer_worker.py --engine llama.cpp|vllm|hispec --model PATH --threads N [engine options]

``--speculative lookup|ngram --num-draft K --ngram N``: the engine's own prompt-lookup speculative
decoding (llama.cpp: ``LlamaPromptLookupDecoding``; vLLM: ``ngram``), drafting up to K tokens from
a match of up to N tokens.

Protocol (one JSON object per line; requests on stdin, replies on the process's original
stdout, while anything the engine prints goes to stderr):

- after loading: ``{"ready": true, "info": {...}}`` or ``{"error": "..."}`` (then it exits 1);
- ``{"op": "generate", "prompts": [[id, ...], ...], "max_new_tokens": N, "eos": [id, ...],
  "ignore_eos": false, "batch_size": B}`` -> ``{"outputs": [[id, ...], ...], "seconds": S}``:
  greedy continuations of the token ids (no text, no BOS added), each ending at its first EOS
  (included) unless ``ignore_eos``; ``seconds`` is the engine's wall time for the whole call;
- ``{"op": "quit"}`` -> exits 0. A request that fails answers ``{"error": "..."}`` and the
  worker goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


class LlamaCpp:
    """llama-cpp-python's ``Llama``: one sequence at a time (its Python API has no batched generation)."""

    batching = False

    def __init__(self, args) -> None:
        import llama_cpp

        draft = None
        if args.speculative:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=args.ngram, num_pred_tokens=args.num_draft)
        self.llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.context, n_batch=512, n_threads=args.threads,
                                   n_threads_batch=args.threads, seed=0, verbose=False, draft_model=draft,
                                   logits_all=draft is not None)  # verifying drafts reads every position's logits
        self.info = {"engine": "llama.cpp", "version": llama_cpp.__version__,
                     "weights": os.path.basename(args.model), "batching": False, "speculative": _spec_info(args)}

    def generate(self, prompts, max_new_tokens, eos, ignore_eos, batch_size):
        return [self._one(ids, max_new_tokens, eos, ignore_eos) for ids in prompts]

    def _one(self, ids, max_new_tokens, eos, ignore_eos):
        self.llm.reset()  # no prefix reuse between requests: every prompt is prefilled in full
        out = []
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0,
                                     repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) >= max_new_tokens or (tok in eos and not ignore_eos):
                break
        return out


class VLLM:
    """vLLM's offline ``LLM``: a list of prompts is one continuous-batching run of up to ``--max-batch``."""

    batching = True

    def __init__(self, args) -> None:
        import vllm

        self.vllm = vllm
        self.max_batch = args.max_batch
        # Prefix caching off: the bench runs the same prompts at every batch size (and warms up on
        # them), so vLLM's cache would hold their K/V from the earlier pass and skip their prefill,
        # while hispec (which has no prefix cache) prefills every prompt every time.
        spec = None
        if args.speculative:
            spec = {"method": "ngram", "num_speculative_tokens": args.num_draft, "prompt_lookup_max": args.ngram,
                    "prompt_lookup_min": 1}
        self.llm = vllm.LLM(model=args.model, dtype=args.dtype, max_model_len=args.context,
                            max_num_seqs=args.max_batch, seed=0, enable_prefix_caching=False,
                            **({"speculative_config": spec} if spec else {}))
        self.info = {"engine": "vllm", "version": vllm.__version__, "dtype": args.dtype, "batching": True,
                     "prefix_caching": False, "speculative": _spec_info(args)}

    def close(self) -> None:
        """Stop vLLM's engine-core process with this one (it would outlive it otherwise)."""
        shutdown = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()

    def generate(self, prompts, max_new_tokens, eos, ignore_eos, batch_size):
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=ignore_eos,
                                          stop_token_ids=list(eos), detokenize=False)
        step = len(prompts) if batch_size >= self.max_batch else max(1, batch_size)  # smaller: static batches
        out = []
        for start in range(0, len(prompts), step):
            chunk = [{"prompt_token_ids": list(ids)} for ids in prompts[start:start + step]]
            for r in self.llm.generate(chunk, params, use_tqdm=False):
                out.append(_cut(list(r.outputs[0].token_ids), eos, ignore_eos))
        return out


class Hispec:
    """hispec (``--strategy``, default ``ar``) with other model options (e.g. other weights' dtype or
    4-bit kernel), in its own process."""

    batching = True

    def __init__(self, args) -> None:
        from hispec.options import add_model_options, load_generator

        p = argparse.ArgumentParser(prog="hispec peer")
        add_model_options(p)
        self.args = p.parse_args(["--model", args.model, "--threads", str(args.threads)] + args.hispec_args)
        self.gen = load_generator(self.args, progress=False)
        self.strategy, self.adaptive = args.strategy, args.adaptive
        self.info = {"engine": "hispec", "options": args.hispec_args, "dtype": str(self.gen.model.dtype),
                     "batching": True, "strategy": args.strategy, "adaptive": args.adaptive}
        self.llms = {}

    def generate(self, prompts, max_new_tokens, eos, ignore_eos, batch_size):
        from hispec.config import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        self.gen.eos_ids = frozenset(eos)
        if batch_size <= 1:
            return [self.gen.generate(list(ids), params, self.strategy, adaptive=self.adaptive).token_ids
                    for ids in prompts]
        from hispec.llm import LLM

        if batch_size not in self.llms:
            self.llms[batch_size] = LLM(self.gen, self.strategy, max_batch_size=batch_size, adaptive=self.adaptive,
                                         prefix_caching=False)
        return [o.token_ids for o in self.llms[batch_size].generate([list(i) for i in prompts], params)]


ENGINES = {"llama.cpp": LlamaCpp, "vllm": VLLM, "hispec": Hispec}


def _spec_info(args) -> dict | None:
    if not args.speculative:
        return None
    return {"mode": args.speculative, "num_draft": args.num_draft, "max_ngram": args.ngram}


def _cut(ids, eos, ignore_eos):
    """Up to and including the first EOS (engines differ in whether they return it)."""
    if not ignore_eos:
        for j, t in enumerate(ids):
            if t in eos:
                return ids[:j + 1]
    return ids


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, choices=sorted(ENGINES))
    p.add_argument("--model", required=True, help="GGUF file (llama.cpp), HF folder (vllm), model name (hispec)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2048, help="context length to allocate")
    p.add_argument("--dtype", default="float32", help="vllm: weights dtype")
    p.add_argument("--max-batch", type=int, default=16, help="vllm: most sequences in one step")
    p.add_argument("--speculative", choices=["lookup", "ngram"], default=None,
                   help="the engine's own prompt-lookup speculative decoding (llama.cpp: lookup, vllm: ngram)")
    p.add_argument("--num-draft", type=int, default=4, help="with --speculative: tokens drafted per round")
    p.add_argument("--ngram", type=int, default=3, help="with --speculative: the longest n-gram matched")
    p.add_argument("--strategy", default="ar", help="hispec: the decoding strategy (ar, hispec, selfspec, lookup)")
    p.add_argument("--adaptive", action="store_true", help="hispec: speculate only where it pays (greedy)")
    p.add_argument("hispec_args", nargs=argparse.REMAINDER, help="hispec: model options after --")
    args = p.parse_args(argv)
    args.hispec_args = [a for a in args.hispec_args if a != "--"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol keeps the real stdout ...
    os.dup2(2, 1)  # ... and whatever the engine prints goes to stderr
    sys.stdout = sys.stderr
    try:
        engine = ENGINES[args.engine](args)
    except BaseException as e:  # noqa: BLE001 - reported to the benchmark, which marks the peer unavailable
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    replies.write(json.dumps({"ready": True, "info": engine.info}) + "\n")
    try:
        return _serve(engine, replies)
    finally:  # also when the benchmark goes away (stdin closes)
        if hasattr(engine, "close"):
            engine.close()


def _serve(engine, replies) -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "quit":
            return 0
        try:
            t0 = time.perf_counter()
            outs = engine.generate(req["prompts"], int(req["max_new_tokens"]), set(req.get("eos", [])),
                                   bool(req.get("ignore_eos")), int(req.get("batch_size", 1)))
            reply = {"outputs": outs, "seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
