"""Offline batches on Ray Data: prompts in, completions with their vectors out, as Parquet.

    python -m deployments.batch --input prompts.jsonl --output out/ [--model builtin:smollm2-135m-instruct]
                                [--max-tokens 32] [--engines 1] [--batch-size 16]
                                [--lora-modules NAME=PATH ... --adapter NAME]

Input rows (JSONL, or Parquet with the same columns): `{"prompt": "..."}` or
`{"messages": [{"role": ..., "content": ...}]}`, with an optional string `id`
(otherwise a hash of the prompt or messages). Output: a folder of Parquet files
with `id`, `prompt_token_ids`, `completion`, `token_ids`, `finish_reason` and
`hidden_states`, a fixed-size float32 list column of the model's hidden size:
each row's vector of prompt + completion, as the server returns it.

Engines run in a Ray Data actor pool (`map_batches` with a callable class):
each actor hosts this project's engine, greedy decoding by default. A rerun
with the same output folder skips the ids already written there, so an
interrupted job resumes instead of starting over (unreadable files a killed
writer left are moved aside). Ray Data shows its own progress on stderr.

LoRA: `--lora-modules` takes the app's adapters (as its `lora_modules`, or
vLLM's `--lora-modules name=path`), `--adapter NAME` picks the one every row is
generated with, and its vectors computed with (default: the base model).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import hashlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def row_id(row: dict[str, Any]) -> str:
    if row.get("id"):
        return str(row["id"])
    content = row.get("prompt") if row.get("prompt") is not None else row.get("messages")
    if hasattr(content, "tolist"):  # Ray Data hands nested lists over as numpy arrays
        content = content.tolist()
    return hashlib.sha1(json.dumps(content, sort_keys=True).encode()).hexdigest()[:20]


def done_ids(output: Path) -> set[str]:
    """Ids already written; files a killed writer left unreadable are moved aside."""
    import pyarrow.parquet as pq

    ids: set[str] = set()
    for f in sorted(output.glob("*.parquet")) if output.exists() else ():
        try:
            ids.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
        except Exception as e:
            logger.warning("moving aside %s, unreadable (an interrupted write?): %s", f.name, e)
            f.rename(f.with_suffix(".parquet.broken"))
    return ids


class EngineWorker:
    """A Ray Data actor: one engine, completing a batch of rows concurrently."""

    def __init__(self, model: str, max_tokens: int, engine_args: dict[str, Any],
                 lora_modules: list[dict] = (), adapter: str | None = None):
        from hidden_states.vllm.engine import HiddenStatesEngine

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.engine = self._run(HiddenStatesEngine.start(model, **engine_args), 900)
        if lora_modules:  # loaded by vLLM's serving, as in the server: adapters are then known by name
            self._run(self.engine.openai(model, "batch", lora_modules), 300)
        self.engine.lora_request(adapter)  # an unknown name fails here, before any row
        self.max_tokens, self.adapter = max_tokens, adapter
        self.tokenizer = self.engine.llm.tokenizer
        # Ray Data deletes this object when its actor exits gracefully (then `__del__`), but not always before the
        # interpreter's exit hooks stop vLLM's engine core under a live output handler: stop it here first.
        atexit.register(self.engine.shutdown)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _prompt_ids(self, prompt: Any, messages: Any) -> list[int]:
        if messages is not None and len(messages):
            return list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return list(self.tokenizer.encode(str(prompt)))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import pyarrow as pa

        from hidden_states.engine import SamplingOptions

        n = len(batch["id"])
        prompts = batch.get("prompt", [None] * n)
        messages = batch.get("messages", [None] * n)
        ids = [self._prompt_ids(p, m) for p, m in zip(prompts, messages)]
        options = SamplingOptions(max_tokens=self.max_tokens, temperature=0.0)

        async def all_rows():
            return await asyncio.gather(*(self.engine.complete(p, options, model=self.adapter) for p in ids))

        done = self._run(all_rows(), 600 + 10 * n)
        vecs = np.stack([c.choices[0].hidden_states for c in done]).astype(np.float32)
        return pa.table({
            "id": pa.array([str(x) for x in batch["id"]]),
            "prompt_token_ids": pa.array([list(c.prompt_token_ids) for c in done], pa.list_(pa.int32())),
            "completion": pa.array([c.choices[0].text for c in done]),
            "token_ids": pa.array([list(c.choices[0].token_ids) for c in done], pa.list_(pa.int32())),
            "finish_reason": pa.array([c.choices[0].finish_reason for c in done]),
            "hidden_states": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), vecs.shape[1]),
        })


def run(args: argparse.Namespace) -> int:
    import ray

    from deployments.config import AppArgs

    t0 = time.monotonic()
    output = Path(args.output)
    skip = done_ids(output)
    ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level="WARNING", include_dashboard=False)
    source = Path(args.input)
    ds = ray.data.read_parquet(str(source)) if source.suffix == ".parquet" else ray.data.read_json(str(source))
    ds = ds.map(lambda row: {**row, "id": row_id(row)})
    if skip:
        print(f"batch: {len(skip)} rows already in {output}: skipping them", file=sys.stderr)
        ds = ds.filter(lambda row: row["id"] not in skip)
    app = AppArgs(model=args.model, engine=json.loads(args.engine) if args.engine else {},
                  lora_modules=[dict(zip(("name", "path"), m.split("=", 1))) for m in args.lora_modules])
    if args.adapter is not None and args.adapter not in app.served_model_names[1:]:
        raise SystemExit(f"--adapter {args.adapter}: not among --lora-modules ({app.served_model_names[1:]})")
    engine_args = {**app.engine_args(), "warm_up_s": args.warm_up_s}
    modules = [m.model_dump() for m in app.lora_modules]
    out = ds.map_batches(EngineWorker, fn_constructor_args=(app.model, args.max_tokens, engine_args, modules,
                                                            args.adapter),
                         batch_size=args.batch_size, compute=ray.data.ActorPoolStrategy(size=args.engines),
                         num_cpus=1, batch_format="numpy")
    out.write_parquet(str(output))
    ray.shutdown()  # the engines' actors end here, not in the interpreter's exit hooks
    total = len(done_ids(output))
    print(f"batch: {total - len(skip)} rows written, {len(skip)} already there: {total} rows in {output} "
          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="a .jsonl or .parquet file of prompt or messages rows")
    ap.add_argument("--output", required=True, help="a folder for the Parquet files (reruns resume)")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--engines", type=int, default=1, help="engine actors (one CPU each on CPU engines)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows per engine call")
    ap.add_argument("--engine", default=None, help="vLLM engine arguments as JSON, over the defaults")
    ap.add_argument("--warm-up-s", type=float, default=0.0, help="CPU warm-up per engine (see AppArgs.warm_up_s)")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="LoRA adapters (the app's lora_modules; vLLM's --lora-modules name=path)")
    ap.add_argument("--adapter", default=None, help="the LoRA adapter (a --lora-modules NAME) to generate with")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
