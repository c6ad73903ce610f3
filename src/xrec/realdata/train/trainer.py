"""`xrec train`: teacher-forced cross-entropy on itemic-token sequences, validation HR@10
through the serving engine after each epoch, early stopping, resumable checkpoints.
`final`: the final fit once validation has chosen the options: every item but the test one
in training, all `epochs`, no validation (the last epoch is the model).

Files: the run works in `OUT.partial/`. `state.json` is the single commit point: it says where
the run stands and names the directories that belong to it, `epoch-N/` (the latest epoch:
`model/`, a servable model directory holding the weights' moving average with `ema`, and
`optimizer.safetensors`: its optimizer state, the training-only look-ahead heads and, with
`ema`, the trained weights) and `best-N/` (the best epoch so far, servable). Each is written
under a `.tmp` name and renamed whole before `state.json` names it; anything `state.json` does
not name (a newer epoch a kill left behind, a torn `.tmp`) is deleted. A killed run started
again with the same options and inputs (the split's and the semantic IDs' digests in
`state.json`) continues after its last committed epoch. When training ends, the best
directory becomes `OUT` (renamed whole: `OUT` never exists half-written) and `OUT.partial/` is
deleted.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from xrec.engine.threads import FollowFreeCores, training_threads
from xrec.model.dtype import dtype_name
from xrec.realdata.data import DataError, Split
from xrec.realdata.train.average import WeightAverage
from xrec.realdata.train.models import TrainableModel, batches, model_config, num_batches
from xrec.realdata.train.options import TrainOptions
from xrec.realdata.train.precision import compile_settings, resolve_train_dtype
from xrec.realdata.sequences import SID_FILES, SidVocabulary, causal_windows, seq2seq_windows
from xrec.utils.progress import bar_disabled

__all__ = ["TrainOptions", "train"]

_HEADS = "heads."
_NO_EXAMPLES = {   # by is_encoder_decoder
    False: "nothing to train on: no user has a training item",
    True: "nothing to train on: the encoder-decoder ({family}) learns every training item but "
          "a user's first, and no user has 2 (the split keeps each user's last 2 interactions "
          "for validation and test); --family qwen3 learns from one, --final trains on the "
          "validation item too"}
MAX_THREADS = 4096  # the serving engine's num_threads limit: validation runs through it   # the training-only weights' keys in optimizer.safetensors


def train(split: Split, sid_dir: str | Path, out_dir: str | Path, options: TrainOptions,
          progress: bool = True, log=print, threads: int | None = None) -> dict:
    """Trains a model on `split`'s training part and writes it to `out_dir` (with the
    semantic-ID files of `sid_dir`, so `xrec serve` loads it as it is). Returns the report
    also written to `out_dir/train_report.json`. `threads`: torch's intra-op threads for
    training and validation (default: torch's; small models train faster on one)."""
    options.check()
    if threads is not None and not 1 <= threads <= MAX_THREADS:   # 0 was torch's, until validation
        raise ValueError(f"threads: got {threads}, expected an integer in [1, {MAX_THREADS}] "
                         f"(or none: torch's count)")
    split.check_evaluated("`xrec train` chooses its epoch on their validation items (and "
                          "a --final model is measured on their test items)")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"{out_dir} exists: choose another --out or delete it")
    vocab = SidVocabulary.read(sid_dir, split.data.item_ids)
    config = model_config(options.family, vocab.vocab_size, options.hidden, options.layers,
                          options.heads, 3 * options.max_items + 8, vocab.bos_id)
    work = out_dir.with_name(out_dir.name + ".partial")
    run = _Run(split, vocab, config, options, work, log, threads)
    with training_threads(threads) as cores, compile_settings():
        run.resume_or_start()
        run.fit(progress, cores)
    report = run.report()
    best = work / run.best_dir
    (best / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    best.rename(out_dir)
    shutil.rmtree(work, ignore_errors=True)
    return report


class _Run:
    def __init__(self, split, vocab, config, options: TrainOptions, work: Path, log, threads):
        if options.final:
            split = split.without_validation()
        self.split, self.vocab, self.config, self.options = split, vocab, config, options
        self.work, self.log, self.threads = work, log, threads
        self.dtype = resolve_train_dtype(options.dtype, options.family)
        self.model = TrainableModel.create(config, options.seed, options.dropout,
                                            options.seen_unlikelihood, options.label_smoothing,
                                            options.lookahead, self.dtype)
        params = self.model.parameters()
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": options.weight_decay},
             {"params": rest, "weight_decay": 0.0}], lr=options.lr)
        self.params = params
        self.average = WeightAverage(params, options.ema) if options.ema else None
        self.epoch, self.step, self.history, self.best = 0, 0, [], None
        self.elapsed, self.stale = 0.0, 0
        self.last_dir = self.best_dir = None     # names under `work`, as state.json has them
        self.inputs = {"split": split_digest(split), "sid": sid_digest(vocab.directory)}
        rng = np.random.default_rng(options.seed)
        users = np.flatnonzero(split.valid >= 0)
        if options.valid_users and len(users) > options.valid_users:
            users = np.sort(rng.choice(users, options.valid_users, replace=False))
        self.valid_users = users
        num_examples = len(self.examples(0))
        if not num_examples:   # else every epoch ran no step and wrote the untrained model
            raise DataError(_NO_EXAMPLES[config.is_encoder_decoder].format(family=options.family))
        self.steps_per_epoch = num_batches(num_examples, options.batch_size)

    # ---- the data of an epoch ------------------------------------------------------------
    def examples(self, epoch: int) -> list:
        """The training sequences of an epoch: the same ones every epoch (`batches`
        shuffles), or with `shifted_windows` windows cut anew from the epoch's seed."""
        windows = seq2seq_windows if self.config.is_encoder_decoder else causal_windows
        rng = (np.random.default_rng([self.options.seed, epoch, 1])
               if self.options.shifted_windows else None)
        return windows(self.vocab, self.split.train, self.options.max_items, rng)

    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 0 over all epochs."""
        total = self.options.epochs * self.steps_per_epoch
        warm = min(self.options.warmup_steps, total // 10 + 1)
        if step < warm:
            return self.options.lr * (step + 1) / warm
        done = min(1.0, (step - warm) / max(1, total - warm))   # shifted windows vary the steps
        return self.options.lr * 0.5 * (1 + math.cos(math.pi * done))

    # ---- resume --------------------------------------------------------------------------
    def resume_or_start(self) -> None:
        state_path = self.work / "state.json"
        if not state_path.is_file():
            shutil.rmtree(self.work, ignore_errors=True)
            self.work.mkdir(parents=True)
            return
        state = json.loads(state_path.read_text())
        if state["options"] != asdict(self.options) or state["sid_dir"] != str(self.vocab.directory):
            raise ValueError(f"{self.work} holds an unfinished run with other options or "
                             f"semantic IDs: delete it to start over, or train with its options "
                             f"({state['options']})")
        if "last_dir" not in state:
            raise ValueError(f"{self.work} holds an unfinished run of an older xrec (no "
                             f"checkpoint named in its state.json): delete it to start over")
        changed = [what for what, digest in self.inputs.items()
                   if state.get("inputs", {}).get(what) != digest]
        if changed:
            said = {"split": "the interaction data (its split) differs",
                    "sid": f"the semantic IDs in {self.vocab.directory} were rebuilt"}
            raise ValueError(f"{self.work} holds an unfinished run on other inputs: "
                             f"{'; '.join(said[c] for c in changed)} since it started. Delete "
                             f"{self.work} to start over, or resume with the inputs it began with")
        self.last_dir, self.best_dir = state["last_dir"], state["best_dir"]
        self.remove_uncommitted()
        last = self.work / self.last_dir
        self.model.load_state(load_file(str(last / "model" / "model.safetensors")))
        optimizer = load_file(str(last / "optimizer.safetensors"))
        if self.average is not None:    # model/ holds the average, the optimizer file the rest
            self.average = WeightAverage(self.params, self.options.ema)
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    p.copy_(optimizer[f"{i}.trained"])
        self.model.load_training_state({k.removeprefix(_HEADS): v for k, v in optimizer.items()
                                        if k.startswith(_HEADS)})
        for i, p in enumerate(self.params):
            if f"{i}.exp_avg" in optimizer:
                self.optimizer.state[p] = {k: optimizer[f"{i}.{k}"]
                                           for k in ("step", "exp_avg", "exp_avg_sq")}
        self.epoch, self.step = state["epoch"], state["step"]
        self.history, self.best = state["history"], state["best"]
        self.elapsed, self.stale = state["elapsed_s"], state["stale"]
        self.log(f"resuming {self.work} after epoch {self.epoch} (best validation HR@10 "
                 f"{self.best and self.best['hr@10']})")

    def remove_uncommitted(self) -> None:
        """Deletes what state.json does not name: checkpoints newer than it, torn `.tmp`s."""
        keep = {"state.json", self.last_dir, self.best_dir}
        for entry in self.work.iterdir():
            if entry.name not in keep:
                if entry.is_dir():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()

    def _publish(self, name: str, write) -> None:
        """`write(directory)` into `name.tmp`, then renamed to `name` whole."""
        tmp, final = self.work / (name + ".tmp"), self.work / name
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        shutil.rmtree(final, ignore_errors=True)   # left by a killed run, never committed
        tmp.rename(final)

    def checkpoint(self) -> None:
        """This epoch's `epoch-N/` (uncommitted until `save_state`)."""
        self.last_dir = f"epoch-{self.epoch}"
        self._publish(self.last_dir, self._write_checkpoint)

    def _write_checkpoint(self, directory: Path) -> None:
        model_dir = directory / "model"
        if self.average is None:
            self.model.save(model_dir)
        else:
            with self.average.in_place():
                self.model.save(model_dir)
        for name in SID_FILES:   # not every file: a model directory as --sid has weights
            if (self.vocab.directory / name).is_file():
                shutil.copy2(self.vocab.directory / name, model_dir / name)
        from xrec.realdata.ranking import PROMPT_FILE
        (model_dir / PROMPT_FILE).write_text(json.dumps(
            {"max_items": self.options.max_items, "format": "bos + 3 tokens per item"}) + "\n")
        optimizer = {_HEADS + k: v.detach().clone()
                     for k, v in self.model.training_state().items()}
        for i, p in enumerate(self.params):
            for k, v in self.optimizer.state.get(p, {}).items():
                optimizer[f"{i}.{k}"] = v.detach().clone()
            if self.average is not None:
                optimizer[f"{i}.trained"] = p.detach().clone()
        save_file(optimizer, str(directory / "optimizer.safetensors"))

    def keep_as_best(self) -> None:
        """The latest epoch's model as `best-N/` (uncommitted until `save_state`)."""
        self.best_dir = f"best-{self.epoch}"
        source = self.work / self.last_dir / "model"
        self._publish(self.best_dir, lambda d: shutil.copytree(source, d, dirs_exist_ok=True))

    def save_state(self) -> None:
        """The commit point: names this epoch's directories, then deletes the others."""
        state = {"options": asdict(self.options), "sid_dir": str(self.vocab.directory),
                 "inputs": self.inputs, "last_dir": self.last_dir, "best_dir": self.best_dir,
                 "epoch": self.epoch, "step": self.step, "history": self.history,
                 "best": self.best, "elapsed_s": self.elapsed, "stale": self.stale}
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.rename(self.work / "state.json")
        self.remove_uncommitted()

    # ---- the loop ------------------------------------------------------------------------
    def fit(self, progress: bool, cores: FollowFreeCores) -> None:
        from tqdm import tqdm

        o = self.options
        if self.dtype == torch.bfloat16:
            self.log("training in bfloat16 (mixed precision: float32 weights; the forward "
                     "pass compiles at the first steps)")
        while self.epoch < o.epochs and self.stale < o.patience and not self.out_of_time():
            started = time.perf_counter()
            rng = np.random.default_rng([o.seed, self.epoch])
            torch.manual_seed(o.seed * 1000 + self.epoch)
            epoch_batches = batches(self.examples(self.epoch), o.batch_size, rng)
            bar = tqdm(epoch_batches, desc=f"epoch {self.epoch + 1}/{o.epochs}",
                       disable=bar_disabled(progress), unit="batch", dynamic_ncols=True)
            total_loss = total_targets = 0.0
            for batch in bar:
                cores.follow()
                for group in self.optimizer.param_groups:
                    group["lr"] = self.learning_rate(self.step)
                loss, targets = self.model.loss(batch)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                self.optimizer.step()
                if self.average is not None:
                    self.average.update(self.step)
                self.step += 1
                total_loss += float(loss.detach()) * targets
                total_targets += targets
                seconds = time.perf_counter() - started
                bar.set_postfix(loss=f"{total_loss / total_targets:.3f}",
                                tok_s=f"{total_targets / seconds:,.0f}")
            bar.close()
            self.epoch += 1
            self.checkpoint()
            hr = None if o.final else self.validate()
            self.elapsed += time.perf_counter() - started
            entry = {"epoch": self.epoch, "loss": total_loss / max(1, total_targets),
                     "valid_hr@10": hr, "elapsed_s": round(self.elapsed, 1)}
            self.history.append(entry)
            if self.best is None or hr is None or hr > self.best["hr@10"]:
                self.best = {"epoch": self.epoch, "hr@10": hr}
                self.stale = 0
                self.keep_as_best()
            else:
                self.stale += 1
            self.save_state()
            validated = ("no validation (final fit)" if hr is None else
                         f"validation HR@10 {hr:.4f} ({len(self.valid_users)} users)")
            self.log(f"epoch {self.epoch}: loss {entry['loss']:.4f}, {validated}, "
                     f"{self.elapsed / 60:.1f} min")
        if self.best is None:
            raise DataError("no epoch finished")

    def out_of_time(self) -> bool:
        return bool(self.options.max_minutes) and self.elapsed > 60 * self.options.max_minutes

    def validate(self) -> float:
        from xrec.realdata.data.metrics import ranking_metrics
        from xrec.realdata.ranking import GenerativeRanker

        ranker = GenerativeRanker.open(self.work / self.last_dir / "model", self.split.data.item_ids,
                                       device="cpu", num_threads=self.threads)
        try:
            ranked = ranker.rank(self.split, "valid", 10, self.options.valid_beam_width,
                                 users=self.valid_users)
        finally:
            ranker.close()
        targets = self.split.valid[self.valid_users]
        return float(ranking_metrics(ranked, targets, ks=(10,))["hr@10"])

    def report(self) -> dict:
        return {"options": asdict(self.options), "dtype": dtype_name(self.dtype),
                "config": self.config.to_dict(),
                "sid_dir": str(self.vocab.directory), "dataset": self.split.data.name,
                "epochs_run": self.epoch, "best": self.best, "history": self.history,
                "train_minutes": round(self.elapsed / 60, 2),
                "parameters": sum(p.numel() for p in self.model.hf.parameters())}


def split_digest(split: Split) -> str:
    """Hex SHA-256 of the split training reads."""
    digest = hashlib.sha256()
    split.update_digest(digest)
    return digest.hexdigest()


def sid_digest(sid_dir: Path) -> str:
    """Hex SHA-256 of a semantic-ID directory's files (its catalog and report among them: a
    rebuild changes them)."""
    digest = hashlib.sha256()
    for f in sorted(Path(sid_dir).iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()
