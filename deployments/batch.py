"""Offline batches on Ray Data: prompts in, completions with their vectors out, as Parquet.

    python -m deployments.batch --input prompts.jsonl --output out/ [--model builtin:smollm2-135m-instruct]
                                [--max-tokens 32] [--engines 1] [--batch-size 16]
                                [--lora-modules NAME=PATH ... --adapter NAME]
                                [--position completion|all|prompt_end|'{"start": -8, "stride": 2}']
                                [--dtype float32|float16|bfloat16] [--topk K] [--proof toploc|JSON]
                                [--heads JSON [--no-rows]] [--steering JSON] [--stop JSON]

Input rows (JSONL or Parquet): `{"prompt": "..."}` or `{"messages": [...]}`, optional string
`id` (default: a hash of the input). A VLM's rows add `images`: a list of image paths (relative to
the input file's folder, read where the engine runs) or data URLs (one string where every row of the
column has one: Arrow reads a column of one type); the row is then a chat whose user message holds
the images, then the prompt's text (`messages` rows carry their images as `image_url` parts
instead). Media are checked as the server checks them. Output Parquet columns: `id`, `prompt_token_ids`,
`completion`, `token_ids`, `finish_reason`, `hidden_states` (fixed-size float32 list of the
hidden size). Several positions: `hidden_states` is list<fixed_size_list> with `positions`
(list<int32>); float16 is halffloat, bfloat16 is float32 of the rounded values; `--topk`
gives `topk_indices`/`topk_values`, `--proof` gives `proofs` (list<string>) instead. `--heads`
registers heads (the app's `heads` arg as JSON, docs/heads.md) and every row reads them all: a
column `head_<name>` each, a struct per position as the API gives it (an SAE's `indices`/`values`,
a linear head's `scores`, `label`); `--no-rows` leaves the rows out. `--steering` and `--stop` are
every row's `hidden_states_steering` and `hidden_states_stop` as the API takes them (docs/steering.md,
docs/heads.md); with `--stop`, a `stop` column holds the condition that finished each row (its
`condition`, `position` and `score`; null where none did).

A rerun into the same folder skips ids already written (unreadable files are moved aside).
`--adapter NAME` picks the LoRA adapter (of `--lora-modules`) every row uses.
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

from hidden_states.params import DTYPES, HiddenStatesFields, HiddenStatesRequestError, spec_of

logger = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """Ray Data hands nested lists over as numpy arrays: plain lists (and their items) again."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def row_id(row: dict[str, Any]) -> str:
    if row.get("id"):
        return str(row["id"])
    content = row.get("prompt") if row.get("prompt") is not None else row.get("messages")
    content = _plain(content)
    if row.get("images") is not None:
        content = [content, _plain(row["images"])]
    return hashlib.sha1(json.dumps(content, sort_keys=True).encode()).hexdigest()[:20]


def image_messages(prompt: Any, images: Any, base: Path) -> list[dict]:
    """A row with `images` as a chat: one user message, the images (paths under `base` read into data
    URLs; data URLs as they are), then the prompt's text."""
    import base64
    import mimetypes

    images = [images] if isinstance(images, str) else list(images)
    parts = []
    for i, image in enumerate(images):
        if not isinstance(image, str) or not image:
            raise ValueError(f"images[{i}]: an image path or a data URL, not {image!r}")
        if not image.startswith("data:"):
            path = base / image
            try:
                data = path.read_bytes()
            except OSError as e:
                raise ValueError(f"images[{i}]: {path} cannot be read ({e.strerror})") from None
            mime = mimetypes.guess_type(path.name)[0] or "image/png"
            image = f"data:{mime};base64," + base64.b64encode(data).decode()
        parts.append({"type": "image_url", "image_url": {"url": image}})
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "" if prompt is None else str(prompt)}]}]


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


def checked(rule):
    """An argparse type: the value converted (JSON, an integer), its message on failure."""

    def parse(value: str):
        try:
            return rule(value)
        except ValueError as e:  # HiddenStatesRequestError, bad JSON, not an integer
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def vectors_column(per_row: list[np.ndarray]):
    """Arrow: a fixed-size list per row from arrays [width], a list of them from arrays [n, width]
    (float16 as halffloat)."""
    import pyarrow as pa

    width = per_row[0].shape[-1]
    inner = pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate([a.reshape(-1) for a in per_row])), width)
    if per_row[0].ndim == 1:
        return inner
    return pa.ListArray.from_arrays(pa.array(np.cumsum([0] + [len(a) for a in per_row]), pa.int32()), inner)


class EngineWorker:
    """A Ray Data actor: one engine, completing a batch of rows concurrently."""

    def __init__(
        self,
        model: str,
        max_tokens: int,
        engine_args: dict[str, Any],
        lora_modules: list[dict] = (),
        adapter: str | None = None,
        spec: bytes = b"",
        base: str = ".",
    ):
        from hidden_states.vllm.engine import HiddenStatesEngine

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.engine = self._run(HiddenStatesEngine.start(model, **engine_args), 900)
        if lora_modules:  # loaded by vLLM's serving, as in the server: adapters are then known by name
            self._run(self.engine.openai(model, "batch", lora_modules), 300)
        self.engine.lora_request(adapter)  # an unknown name fails here, before any row
        # The job's spec, as main() parsed it (default: the final token's vector); what the model cannot
        # serve fails here, before any row.
        self.spec = HiddenStatesFields.from_json(spec) if spec else spec_of(enabled=True)
        self.engine.check_spec(self.spec)
        self.engine.heads_of(self.spec)
        self.engine.steering_of(self.spec)
        self.engine.stop_of(self.spec)
        self.max_tokens, self.adapter, self.base = max_tokens, adapter, Path(base)
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

    async def _engine_input(self, row_id: str, prompt: Any, messages: Any, images: Any) -> Any:
        """A row's engine input: the prompt's token ids, or a chat's (with its media processed as the
        server processes them); a bad row stops the job, naming it."""
        from hidden_states.media import check_media

        images, messages = _plain(images), _plain(messages)
        try:
            if images:
                messages = image_messages(prompt, images, self.base)
            if messages:
                check_media({"messages": messages})
                return await self.engine.chat_input(messages)
        except (ValueError, HiddenStatesRequestError) as e:
            raise ValueError(f"row {row_id}: {e}") from None
        return list(self.tokenizer.encode(str(prompt)))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import pyarrow as pa

        from hidden_states.interface import SamplingOptions

        n = len(batch["id"])
        prompts = batch.get("prompt", [None] * n)
        messages = batch.get("messages", [None] * n)
        images = batch.get("images", [None] * n)
        options = SamplingOptions(max_tokens=self.max_tokens, temperature=0.0)

        async def all_rows():
            inputs = [
                await self._engine_input(str(i), p, m, im)
                for i, p, m, im in zip(batch["id"], prompts, messages, images)
            ]
            return await asyncio.gather(
                *(self.engine.complete(p, options, model=self.adapter, spec=self.spec) for p in inputs)
            )

        done = self._run(all_rows(), 600 + 10 * n)
        choices = [c.choices[0] for c in done]
        out = {
            "id": pa.array([str(x) for x in batch["id"]]),
            "prompt_token_ids": pa.array([list(c.prompt_token_ids) for c in done], pa.list_(pa.int32())),
            "completion": pa.array([ch.text for ch in choices]),
            "token_ids": pa.array([list(ch.token_ids) for ch in choices], pa.list_(pa.int32())),
            "finish_reason": pa.array([ch.finish_reason for ch in choices]),
        }
        if self.spec.hidden_states_proof is not None:
            out["proofs"] = pa.array([list(ch.proofs) for ch in choices], pa.list_(pa.string()))
            return pa.table(out)
        if self.spec.hidden_states_stop:  # the condition that finished each row, or null
            out["stop"] = pa.array(
                [
                    None if ch.stop is None else {k: ch.stop[k] for k in ("condition", "position", "score")}
                    for ch in choices
                ],
                pa.struct([("condition", pa.int32()), ("position", pa.int32()), ("score", pa.float32())]),
            )
        for name, _ in self.spec.heads:  # the API's structs, one per position (a list of them for several)
            out[f"head_{name}"] = pa.array([ch.heads[name] for ch in choices])
        if choices[0].positions is not None:
            out["positions"] = pa.array([list(ch.positions) for ch in choices], pa.list_(pa.int32()))
        if not self.spec.return_hidden_states:  # heads alone
            return pa.table(out)
        values = vectors_column([ch.hidden_states for ch in choices])  # the dtype asked (bfloat16: float32)
        if self.spec.hidden_states_topk:
            out["topk_indices"] = vectors_column([np.asarray(ch.hidden_states_indices, np.int32) for ch in choices])
            out["topk_values"] = values
        else:
            out["hidden_states"] = values
        return pa.table(out)


def worker_resources(app: Any) -> dict[str, float]:
    """Ray resources for one engine actor (AppArgs `app`), as a replica's: a CPU engine one CPU per
    worker (tensor-parallel rank x pipeline stage); a GPU engine one GPU per worker (vLLM runs them as the
    actor's own processes)."""
    tp = app.ranks()
    if app.resolved_accelerator() == "cpu":
        return {"num_cpus": tp}
    return {"num_cpus": 1, "num_gpus": tp}


def run(args: argparse.Namespace) -> int:
    import ray

    from deployments.config import AppArgs

    t0 = time.monotonic()
    output = Path(args.output)
    skip = done_ids(output)
    # A cluster of its own unless RAY_ADDRESS names one: never a running server's, whose engines hold its CPUs.
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", logging_level="WARNING", include_dashboard=False)
    source = Path(args.input)
    ds = ray.data.read_parquet(str(source)) if source.suffix == ".parquet" else ray.data.read_json(str(source))
    ds = ds.map(lambda row: {**row, "id": row_id(row)})
    if skip:
        print(f"batch: {len(skip)} rows already in {output}: skipping them", file=sys.stderr)
        ds = ds.filter(lambda row: row["id"] not in skip)
    app = AppArgs(
        model=args.model,
        engine=json.loads(args.engine) if args.engine else {},
        accelerator=args.accelerator,
        lora_modules=[dict(zip(("name", "path"), m.split("=", 1))) for m in args.lora_modules],
    )
    if args.adapter is not None and args.adapter not in app.served_model_names[1:]:
        raise SystemExit(f"--adapter {args.adapter}: not among --lora-modules ({app.served_model_names[1:]})")
    engine_args = {**app.engine_args(), "warm_up_s": args.warm_up_s, "heads": args.heads}
    modules = [m.model_dump() for m in app.lora_modules]
    out = ds.map_batches(
        EngineWorker,
        fn_constructor_args=(
            app.model,
            args.max_tokens,
            engine_args,
            modules,
            args.adapter,
            args.spec,
            str(source.resolve().parent),
        ),
        batch_size=args.batch_size,
        compute=ray.data.ActorPoolStrategy(size=args.engines),
        batch_format="numpy",
        **worker_resources(app),
    )
    out.write_parquet(str(output))
    ray.shutdown()  # the engines' actors end here, not in the interpreter's exit hooks
    total = len(done_ids(output))
    print(
        f"batch: {total - len(skip)} rows written, {len(skip)} already there: {total} rows in {output} "
        f"({time.monotonic() - t0:.0f} s)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help="a .jsonl or .parquet file of prompt or messages rows")
    ap.add_argument("--output", required=True, help="a folder for the Parquet files (reruns resume)")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--engines", type=int, default=1, help="engine actors (each asks for what its engine runs on: --accelerator)"
    )
    ap.add_argument(
        "--accelerator",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="what each engine actor asks Ray for: a CPU per tensor-parallel worker (cpu), or a GPU "
        "per worker (gpu); auto: cpu where vLLM's CPU build is installed, else gpu",
    )
    ap.add_argument("--batch-size", type=int, default=16, help="rows per engine call")
    ap.add_argument("--engine", default=None, help="vLLM engine arguments as JSON, over the defaults")
    ap.add_argument("--warm-up-s", type=float, default=0.0, help="CPU warm-up per engine (see AppArgs.warm_up_s)")
    ap.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (the app's lora_modules; vLLM's --lora-modules name=path)",
    )
    ap.add_argument("--adapter", default=None, help="the LoRA adapter (a --lora-modules NAME) to generate with")
    ap.add_argument(
        "--position",
        default="completion_end",
        type=checked(lambda v: json.loads(v) if v.lstrip().startswith("{") else v),
        help="hidden_states_position: completion_end (default), prompt_end, completion, all, or a range "
        'as JSON, e.g. \'{"start": -8, "end": null, "stride": 2}\'',
    )
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="hidden_states_dtype")
    ap.add_argument(
        "--topk", type=checked(int), default=None, help="hidden_states_topk: the K largest |values| per position"
    )
    ap.add_argument(
        "--proof",
        default=None,
        type=checked(lambda v: {"scheme": v} if not v.lstrip().startswith("{") else json.loads(v)),
        help='hidden_states_proof: each row\'s TOPLOC proofs (a "proofs" column): toploc, or JSON, e.g. '
        '\'{"scheme": "toploc", "topk": 128, "decode_batching_size": 32}\'',
    )
    ap.add_argument(
        "--heads",
        default=[],
        type=checked(json.loads),
        help="heads to register and read on every row, as the app's `heads` arg in JSON, e.g. "
        '\'[{"name": "sae", "path": "saes/layer12"}]\' (a column head_<name> each)',
    )
    ap.add_argument("--no-rows", action="store_true", help="with --heads: their columns alone, no hidden_states")
    ap.add_argument(
        "--steering",
        default=None,
        type=checked(json.loads),
        help="every row's hidden_states_steering as JSON (docs/steering.md)",
    )
    ap.add_argument(
        "--stop",
        default=None,
        type=checked(json.loads),
        help="every row's hidden_states_stop as JSON (docs/heads.md): a `stop` column",
    )
    args = ap.parse_args(argv)
    if args.no_rows and not args.heads:
        ap.error("--no-rows goes with --heads (without them a row would carry nothing)")
    try:  # the job's hidden-states fields: parsed once, as a request's (params.parse_fields)
        from deployments.config import HeadEntry

        args.heads = [HeadEntry.model_validate(h).model_dump(exclude_none=True) for h in args.heads]
        for h in args.heads:
            h["path"] = os.path.abspath(h["path"])  # engine actors may run in another folder
        heads = [h["name"] for h in args.heads] or None
        args.spec = spec_of(
            not args.no_rows,
            None,
            args.position,
            args.dtype,
            args.topk,
            args.proof,
            heads,
            args.steering,
            args.stop,
            enabled=True,
        ).to_json()
    except (HiddenStatesRequestError, ValueError) as e:
        ap.error(str(e))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
