"""Train an EDD draft for a target (edd_pct.txt, section 3.1), from the user's own images, videos and prompts.

::

    vlmspec edd train --target Qwen/Qwen2-VL-7B-Instruct --data examples.jsonl --out my_edd
    vlmspec edd train --target testbed-base --data testbed --examples 200 --out edd   # the testbed world's scenes
    pipe = VLMSpecPipeline.from_pretrained(target, draft="my_edd", policy="pct")

(also ``python -m vlmspec.edd_train train ...``). ``examples.jsonl`` holds ``{"prompt": ..., "image": path |
[paths] | null, "video": path | null}`` per line, as ``vlmspec c2t collect`` takes.

1. **Self-distillation data.** The frozen target answers every prompt itself (greedy, ``max_new_tokens``), so the
   draft learns the target's own replies on the user's own media. One prefill and one forward over the reply give
   the soft prompt (the output of :attr:`~vlmspec.models.edd.EDDConfig.hidden_layer` at every position) and the
   target's next-token distribution at every reply position (kept as its ``teacher_top_k`` most likely tokens,
   renormalised: exact on the testbed's 699-token vocabulary; a real 150k vocabulary would need ~60 MB per example
   in full). Collected once, saved as ``data.safetensors`` in ``--out`` with the key of everything that shaped
   it (each example's prompt and media identity, layer, reply length, top-k, the target's dtype and signature:
   :func:`~vlmspec.edd_state.data_key`); a file of another key is regenerated. While it is collected each
   example's sample is saved in ``data-parts/``, so a killed run collects only the examples not done yet.
2. **Dual-block training** (Eq. 3, Fig. 3a). One forward per example over ``[soft prompt rows | reply token
   rows]``: the reply is cut into blocks of a random length in ``[block_min, block_max]`` (drawn anew at every
   step, paper: 5-10); a token row sees the token rows before it in its own block and the soft-prompt rows before
   its block's first position, exactly what it sees at inference when that block's first token is a root. Loss:
   ``KL(P_target || P_draft)`` (Eq. 4), mean over reply rows. AdamW, learning rate 1e-4, batch 8 (gradients
   accumulated over examples), one epoch: the paper's settings are the defaults.
3. **Checkpoints** every ``checkpoint_every`` steps and at the end in ``--out/checkpoint`` (draft weights and
   AdamW state as safetensors, the step and the settings as JSON; no pickle), written so that a crash at any
   moment leaves the previous checkpoint or the new one, whole (:mod:`vlmspec.edd_state`). A run started again
   with the same ``--out`` resumes from the last checkpoint if its settings are the checkpoint's
   (:func:`~vlmspec.edd_state.training_settings`; other ones are refused, naming the flag); every random choice is
   drawn from ``(seed, step)``, so a resumed run ends with the same weights as an uninterrupted one. The final
   draft (``edd_config.json`` + ``model.safetensors``, with the target it was trained for) is written to
   ``--out``, which must be new, empty or one an earlier run wrote.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .c2t_tools import Example, load_examples
from .edd_state import (
    CHECKPOINT,
    DATA_NAME,
    DATA_PARTS,
    check_out_folder,
    data_key,
    load_checkpoint,
    read_json,
    save_checkpoint,
    save_draft,
    stored_data_key,
    training_settings,
    write_atomic,
    write_json_atomic,
)
from .errors import InvalidInputError
from .models import EDDDraft, VLMAdapter, adapter_for
from .models.edd import check_target, is_edd_folder, read_config
from .tree import tree_attention_bias


@dataclass
class EDDTrainConfig:
    """Training settings (defaults: the paper's, section 4.1).

    Attributes:
        epochs: passes over the data.
        lr: AdamW learning rate.
        batch_size: examples per optimiser step (gradients accumulated).
        block_min, block_max: the random block length's range (inclusive).
        weight_decay: AdamW weight decay.
        max_new_tokens: length of the target's own replies (self-distillation).
        teacher_top_k: target probabilities kept per reply position.
        hidden_layer: target layer read (``None``: :func:`~vlmspec.models.edd.default_hidden_layer`).
        use_hidden: ``False`` trains the paper's ablation "w/o encoding result": the draft sees the prompt's and
            the reply's *token embeddings* instead of the target's hidden states (same size, same data).
        checkpoint_every: steps between checkpoints.
        seed: seeds the data order and the block lengths.
    """

    epochs: int = 1
    lr: float = 1e-4
    batch_size: int = 8
    block_min: int = 5
    block_max: int = 10
    weight_decay: float = 0.0
    max_new_tokens: int = 128
    teacher_top_k: int = 1024
    hidden_layer: int | None = None
    use_hidden: bool = True
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "epochs",
            "batch_size",
            "block_min",
            "max_new_tokens",
            "teacher_top_k",
            "checkpoint_every",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(f"EDDTrainConfig.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.block_max, int) or self.block_max < self.block_min:
            raise InvalidInputError(
                f"EDDTrainConfig.block_max must be an integer >= block_min ({self.block_min}), got {self.block_max!r}"
            )
        if not (isinstance(self.lr, int | float) and self.lr > 0 and math.isfinite(self.lr)):
            raise InvalidInputError(f"EDDTrainConfig.lr must be a positive number, got {self.lr!r}")
        wd = self.weight_decay
        if isinstance(wd, bool) or not (isinstance(wd, int | float) and wd >= 0 and math.isfinite(wd)):
            raise InvalidInputError(
                f"EDDTrainConfig.weight_decay (--weight-decay) must be a number >= 0, got {wd!r}"
            )


@dataclass
class Sample:
    """One self-distilled example.

    Attributes:
        soft: ``[S, D]`` target hidden states of prompt and reply (the soft prompt's rows).
        positions: ``[..., 1, S]`` the target's rotary position ids.
        prompt_len: ``P``, prompt tokens; the reply is positions ``P .. S-1``.
        tokens: ``[S]`` token ids of prompt and reply.
        top_ids, top_probs: ``[R, k]`` the target's distribution after each reply token (row ``j`` follows
            reply token ``j`` and predicts the next one).
    """

    soft: torch.Tensor
    positions: torch.Tensor
    prompt_len: int
    tokens: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor


# ---- 1. self-distillation -----------------------------------------------------------------------------------------
@torch.no_grad()
def distill_example(pipe: Any, example: Example, layer: int, max_new_tokens: int, top_k: int) -> Sample:
    """The target's reply to ``example`` with its hidden states and distributions (see the module docstring)."""
    target: VLMAdapter = adapter_for(pipe.target)
    inputs = pipe.prepare_inputs(example.image, example.prompt, example.video)
    reply = pipe.reference_generate(inputs, max_new_tokens)  # the target's own greedy reply
    prefill = target.prefill(inputs, hidden_layer=layer)
    prompt_len = inputs["input_ids"].shape[1]
    tokens = torch.tensor(reply, device=target.device)  # [R]
    positions = torch.arange(prompt_len, prompt_len + len(reply), device=target.device)
    causal = torch.ones(len(reply), len(reply), dtype=torch.bool, device=target.device).tril()
    logits, hidden = target.forward_hidden(
        prefill.state, tokens, positions, tree_attention_bias(causal, prompt_len, target.dtype), layer
    )  # [R, V], [R, D]
    probs = torch.softmax(logits.float(), dim=-1)
    top_probs, top_ids = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    return Sample(
        soft=torch.cat([prefill.hidden, hidden]).float().cpu(),
        positions=torch.cat(
            [prefill.position_ids, target.rope_ids(positions, prefill.state.rope_delta)], dim=-1
        ).cpu(),
        prompt_len=prompt_len,
        tokens=torch.cat([inputs["input_ids"][0], tokens]).cpu(),
        top_ids=top_ids.cpu(),
        top_probs=(top_probs / top_probs.sum(-1, keepdim=True)).cpu(),
    )


def save_samples(samples: Sequence[Sample], path: Path, meta: dict[str, Any]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for i, s in enumerate(samples):
        for name in ("soft", "positions", "tokens", "top_ids", "top_probs"):
            tensors[f"{i}.{name}"] = getattr(s, name).contiguous()
        tensors[f"{i}.prompt_len"] = torch.tensor(s.prompt_len)
    metadata = {"meta": json.dumps(meta, sort_keys=True)}
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_samples(path: Path) -> list[Sample]:
    state = load_file(str(path))
    count = len({key.split(".")[0] for key in state})
    return [
        Sample(
            soft=state[f"{i}.soft"],
            positions=state[f"{i}.positions"],
            prompt_len=int(state[f"{i}.prompt_len"]),
            tokens=state[f"{i}.tokens"],
            top_ids=state[f"{i}.top_ids"],
            top_probs=state[f"{i}.top_probs"],
        )  # fmt: skip
        for i in range(count)
    ]


# ---- 2. the dual-block loss ---------------------------------------------------------------------------------------
def block_starts(prompt_len: int, length: int, block: int) -> torch.Tensor:
    """``[R]`` the first position of each reply position's block (blocks of ``block`` from ``prompt_len``)."""
    offsets = torch.arange(length - prompt_len)
    return prompt_len + offsets - offsets % block


def dual_block_mask(prompt_len: int, length: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, S + R, S + R]`` additive mask over ``[S soft rows | R reply token rows]`` (Fig. 3a).

    Soft row ``a`` sees soft rows ``<= a``; the token row of position ``i`` (block starting at ``s``) sees soft
    rows ``< s`` and the token rows ``s .. i``.
    """
    reply = length - prompt_len
    start = block_starts(prompt_len, length, block)  # [R]
    position = torch.arange(prompt_len, length)  # [R]
    soft = torch.arange(length)
    visible = torch.zeros(length + reply, length + reply, dtype=torch.bool)
    visible[:length, :length] = soft[None, :] <= soft[:, None]
    visible[length:, :length] = soft[None, :] < start[:, None]
    visible[length:, length:] = (position[None, :] >= start[:, None]) & (
        position[None, :] <= position[:, None]
    )
    return tree_attention_bias(visible, 0, dtype)


def block_logits(draft: EDDDraft, sample: Sample, block: int, use_hidden: bool) -> torch.Tensor:
    """``[R, V]`` the draft's logits after each reply token, all blocks in one forward (dual-block mask)."""
    weight = draft.lm_head.weight
    length, prompt_len = sample.tokens.shape[0], sample.prompt_len
    embed = draft.get_input_embeddings()
    tokens = sample.tokens.to(weight.device)
    soft = sample.soft.to(weight.device, weight.dtype) if use_hidden else embed(tokens)  # [S, D]
    rows = torch.cat([soft, embed(tokens[prompt_len:])])[None]  # [1, S + R, D]
    positions = sample.positions.to(weight.device)
    positions = torch.cat([positions, positions[..., prompt_len:]], dim=-1)
    mask = dual_block_mask(prompt_len, length, block, weight.dtype).to(weight.device)
    return draft(rows, position_ids=positions, attention_mask=mask, cache=None)[0, length:]  # the token rows


def kl_to_target(logits: torch.Tensor, sample: Sample) -> torch.Tensor:
    """``KL(P_target || P_draft)`` (Eq. 4), mean over the reply rows (the target's kept top-k, renormalised)."""
    log_draft = torch.log_softmax(logits.float(), dim=-1).gather(-1, sample.top_ids.to(logits.device))
    teacher = sample.top_probs.to(logits.device)
    return (teacher * (teacher.clamp_min(1e-12).log() - log_draft)).sum(-1).mean()


@torch.no_grad()
def evaluate(
    draft: EDDDraft, samples: Sequence[Sample], block: int, use_hidden: bool = True
) -> dict[str, float]:
    """Held-out KL and greedy acceptance under the dual-block mask.

    Each block is one drafting step whose root is the block's first token: the draft's greedy proposals along
    the block are accepted while they equal the target's own next token (the sample's reply is the target's
    greedy reply, so this is exactly a ``chain`` step of ``gamma = block``, without its decoding loop).

    Returns:
        ``{"kl": mean KL per reply position, "accepted": mean accepted tokens per block, "blocks": count}``.
    """
    kls, accepted = [], []
    for sample in samples:
        logits = block_logits(draft, sample, block, use_hidden)
        kls.append(float(kl_to_target(logits, sample)))
        matches = logits.argmax(-1).cpu() == sample.top_ids[:, 0]  # [R]
        for start in range(0, matches.shape[0], block):
            run = matches[start : start + block]  # the block's proposals, one per row
            accepted.append(int(run.long().cumprod(0).sum()))
    if not accepted:
        raise InvalidInputError("nothing to evaluate: give --data with at least one example that has a reply")
    return {"kl": sum(kls) / len(kls), "accepted": sum(accepted) / len(accepted), "blocks": len(accepted)}


# ---- 3. the loop, with resumable checkpoints ----------------------------------------------------------------------
def _batches(count: int, config: EDDTrainConfig) -> Iterator[tuple[int, list[int]]]:
    step = 0
    for epoch in range(config.epochs):
        order = torch.randperm(
            count, generator=torch.Generator().manual_seed(config.seed * 1000 + epoch)
        ).tolist()
        for start in range(0, count, config.batch_size):
            yield step, order[start : start + config.batch_size]
            step += 1


def _block_length(config: EDDTrainConfig, step: int) -> int:
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    return int(torch.randint(config.block_min, config.block_max + 1, (1,), generator=generator))


def train(
    pipe: Any,
    examples: Sequence[Example],
    out: str | Path,
    config: EDDTrainConfig | None = None,
    target_name: str = "",
    progress: bool = True,
) -> EDDDraft:
    """Train an EDD draft for ``pipe.target`` on ``examples`` and save it in ``out`` (resuming if possible).

    Args:
        pipe: a :class:`~vlmspec.VLMSpecPipeline` holding the (frozen) target and its processor.
        examples: prompts with their images/videos.
        out: output folder (draft, data, checkpoint): new, empty, or one an earlier run wrote.
        config: training settings (default: the paper's).
        target_name: recorded in the draft's config, for messages.
        progress: show a progress bar.

    Raises:
        ValueError: ``out`` holds other files, a draft or checkpoint of another target, a checkpoint of a run with
            other settings (:func:`~vlmspec.edd_state.training_settings`) or a damaged one; or no examples.
    """
    from tqdm.auto import tqdm

    config = config or EDDTrainConfig()
    out = Path(out)
    if not examples:
        raise InvalidInputError("no training examples: give --data with at least one example")
    check_out_folder(out)
    if is_edd_folder(out):
        check_target(read_config(out), pipe.target, where=str(out))
    torch.manual_seed(config.seed)
    draft = EDDDraft.for_target(pipe.target, config.hidden_layer, target_name=target_name).float().train()
    layer = draft.edd_config.hidden_layer
    shaping = {"layer": layer, "max_new_tokens": config.max_new_tokens, "teacher_top_k": config.teacher_top_k,
               "dtype": str(pipe.target.dtype), "target": [type(pipe.target).__name__,
               [round(x, 4) for x in draft.edd_config.target_signature]]}  # fmt: skip
    key = data_key(examples, shaping)
    settings = training_settings(config, layer, key)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    first = load_checkpoint(out / CHECKPOINT, draft, optimizer, pipe.target, settings)  # before any data work
    samples = _self_distilled(pipe, examples, out / DATA_NAME, config, layer, key, progress)
    batches = list(_batches(len(samples), config))
    bar = tqdm(batches[first:], desc="edd: training", disable=not progress, initial=first, total=len(batches))
    losses: list[float] = []
    for step, batch in bar:
        block = _block_length(config, step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for index in batch:
            sample = samples[index]
            loss = kl_to_target(block_logits(draft, sample, block, config.use_hidden), sample) / len(batch)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
        bar.set_postfix(kl=f"{total:.3f}")
        if (step + 1) % config.checkpoint_every == 0 or step == len(batches) - 1:
            save_checkpoint(out / CHECKPOINT, draft, optimizer, step, settings)
    draft.eval()
    draft.edd_config.training = {**asdict(config), "steps": len(batches), "examples": len(samples)}
    if losses:
        draft.edd_config.training["final_kl"] = round(sum(losses[-10:]) / len(losses[-10:]), 4)
    save_draft(draft, out)
    return draft


def _self_distilled(
    pipe: Any,
    examples: Sequence[Example],
    path: Path,
    config: EDDTrainConfig,
    layer: int,
    key: str,
    progress: bool,
) -> list[Sample]:
    """The self-distillation data: ``path`` when its recorded key is ``key`` (same examples and settings), else
    generated anew and saved there (a stale file is a cache of other inputs: regenerating is always right).

    While it is generated, each example's sample is saved (atomically) in ``data-parts/`` beside ``path``, so a
    killed run's next start only generates the examples not done yet; parts made from other inputs are cleared."""
    from tqdm.auto import tqdm

    if stored_data_key(path) == key:
        return load_samples(path)
    parts = path.parent / DATA_PARTS
    if read_json(parts / "key.json") != key:
        shutil.rmtree(parts, ignore_errors=True)
        parts.mkdir(parents=True)
        write_json_atomic(parts / "key.json", key)
    samples = []
    for i, example in enumerate(tqdm(examples, desc="edd: target replies", disable=not progress)):
        part = parts / f"{i:08d}.safetensors"
        done = load_samples(part) if stored_data_key(part) == key else None
        if done is None:
            done = [distill_example(pipe, example, layer, config.max_new_tokens, config.teacher_top_k)]
            save_samples(done, part, {"key": key})
        samples.append(done[0])
    meta = {"key": key, "examples": len(examples), "layer": layer, "max_new_tokens": config.max_new_tokens}
    save_samples(samples, path, meta)
    shutil.rmtree(parts, ignore_errors=True)
    return samples


# ---- the command line -----------------------------------------------------------------------------------------------
def examples_from_testbed(count: int, seed: int = 0) -> list[Example]:
    """``count`` examples of the testbed world (image captions, video captions and image questions, in turn),
    drawn from training seeds (never those the bench and the tests use)."""
    from .testbed import sample
    from .testbed.train import TRAIN_SEED_OFFSET

    tasks = ("image_caption", "video_caption", "image_qa")
    found = []
    for i in range(count):
        example = sample(tasks[i % len(tasks)], TRAIN_SEED_OFFSET + seed * 100_000 + i)
        found.append(Example(prompt=example.prompt, image=example.image, video=example.video))
    return found


def _parser(prog: str) -> argparse.ArgumentParser:
    from .cli import ArgumentParser, positive_int

    parser = ArgumentParser(prog=prog, description="EDD drafts (edd_pct.txt section 3.1)")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train an EDD draft for a target by self-distillation")
    tr.add_argument("--target", required=True, help="target: hub id, folder or pair name (e.g. testbed-base)")
    tr.add_argument(
        "--data", required=True, help="examples .jsonl ({prompt, image, video} per line) or 'testbed'"
    )
    tr.add_argument(
        "--examples", type=positive_int, default=None, help="use the first N examples (testbed: draw N)"
    )
    tr.add_argument("--out", required=True, help="output folder (resumes when it holds a checkpoint)")
    defaults = EDDTrainConfig()
    for name in ("epochs", "batch_size", "block_min", "block_max", "max_new_tokens", "teacher_top_k", "seed",
                 "checkpoint_every", "hidden_layer"):  # fmt: skip
        tr.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    tr.add_argument("--lr", type=float, default=defaults.lr)
    tr.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    tr.add_argument(
        "--no-hidden", action="store_true", help="ablation: token embeddings instead of hidden states"
    )
    tr.add_argument(
        "--dtype", default="float32", help="the target's dtype while it encodes (default float32)"
    )
    tr.add_argument("--quiet", action="store_true", help="no progress bars")
    ev = sub.add_parser("eval", help="held-out KL and greedy acceptance of a trained draft (dual-block mask)")
    ev.add_argument("--target", required=True, help="the target the draft was trained for")
    ev.add_argument("--draft", required=True, help="EDD draft folder")
    ev.add_argument(
        "--data", required=True, help="examples .jsonl or 'testbed' (held-out seeds with --seed 1)"
    )
    ev.add_argument("--examples", type=positive_int, default=None)
    ev.add_argument(
        "--block", type=positive_int, default=6, help="block length = chain length evaluated (default 6)"
    )
    ev.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    ev.add_argument("--seed", type=int, default=1)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "vlmspec edd") -> int:
    args = _parser(prog).parse_args(argv)
    from .cli import check_output_path
    from .named_pairs import resolve_pair
    from .pipeline import VLMSpecPipeline

    if args.command == "train":
        check_output_path(args.out, "--out")
        check_out_folder(Path(args.out))
    if args.data == "testbed":
        examples = examples_from_testbed(200 if args.examples is None else args.examples, args.seed)
    else:
        examples = load_examples(args.data)[: args.examples]
        if not examples:
            raise InvalidInputError(
                f"--data {args.data!r} holds no examples: give a .jsonl with at least one line"
            )
    if args.command == "eval":
        pipe = VLMSpecPipeline.from_pretrained(args.target, policy="ar", torch_dtype=torch.float32)
        draft = EDDDraft.from_pretrained(resolve_pair(args.target, args.draft).draft, pipe.target).float()
        layer = draft.edd_config.hidden_layer
        samples = [distill_example(pipe, e, layer, args.max_new_tokens, 1024) for e in examples]
        use_hidden = draft.edd_config.training.get("use_hidden", True)
        result = evaluate(draft, samples, args.block, use_hidden)
        print(json.dumps({"draft": args.draft, "use_hidden": use_hidden, "block": args.block, **result}))
        return 0
    config = EDDTrainConfig(
        epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, block_min=args.block_min,
        block_max=args.block_max, weight_decay=args.weight_decay, max_new_tokens=args.max_new_tokens,
        teacher_top_k=args.teacher_top_k, hidden_layer=args.hidden_layer, use_hidden=not args.no_hidden,
        checkpoint_every=args.checkpoint_every, seed=args.seed,
    )  # fmt: skip
    pipe = VLMSpecPipeline.from_pretrained(args.target, policy="ar", torch_dtype=args.dtype)
    draft = train(pipe, examples, args.out, config, target_name=args.target, progress=not args.quiet)
    print(f"wrote {args.out}: EDD draft reading target layer {draft.edd_config.hidden_layer} "
          f"({draft.edd_config.training.get('steps')} steps, final KL {draft.edd_config.training.get('final_kl')})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
