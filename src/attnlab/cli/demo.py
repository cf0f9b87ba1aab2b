"""``attnlab demo``: teach an encoder-decoder Transformer to turn dates written by people into
ISO 8601, on a CPU, in a few minutes — and show what it learned.

``run_date_demo`` trains (or reuses the checkpoint in ``out_dir``), measures exact match on
2,000 held-out dates with greedy decoding and beam search, prints translations, and saves
cross-attention heatmaps. ``run_attention_demo`` is a short tour of the attention API.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from attnlab.analysis import capture_attention, plot_attention_heads
from attnlab.attention import MultiHeadAttention, scaled_dot_product_attention
from attnlab.cli import add_command
from attnlab.cli.train import time_estimate
from attnlab.masks import causal_mask, combine_masks, padding_mask
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.threads import add_threads_option
from attnlab.training.checkpoint import load_model
from attnlab.training.tasks.seq2seq import Seq2SeqTask, exact_match, make_seq2seq_task
from attnlab.training.trainer import TrainConfig, Trainer

__all__ = ["DEMO_EXAMPLES", "add_commands", "demo_model_config", "run_attention_demo",
           "run_date_demo"]

DEMO_EXAMPLES = (
    "21 November 2026",
    "Nov 21, 2026",
    "11/21/26",
    "saturday, the 21st of november 2026",
    "2026年11月21日",
    "21.11.2026",
    "the 3rd of march 1901",
    "JULY 4TH, 1976",
)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``demo`` on the top-level sub-parsers."""
    demo = add_command(sub, "demo", __doc__)
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.add_argument(
        "--retrain", action="store_true", help="train again even if a checkpoint exists"
    )
    demo.add_argument("--steps", type=int, default=1200, help="training steps")
    demo.add_argument("--batch-size", type=int, default=128, help="examples per training step")
    demo.add_argument("--intro", action="store_true", help="only a short tour of the attention API")
    add_threads_option(demo)
    demo.set_defaults(handler=_run_demo)


def demo_model_config(task: Seq2SeqTask) -> TransformerConfig:
    """The demo's model: 2 + 2 Pre-LN layers, d=128, 8 heads (about 0.9 M parameters)."""
    return TransformerConfig(
        src_vocab_size=len(task.src_vocab),
        tgt_vocab_size=len(task.tgt_vocab),
        d_model=128,
        num_heads=8,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=512,
        dropout=0.0,
        norm_first=True,
        max_len=64,
    )


def demo_train_config(steps: int = 1200, batch_size: int = 128) -> TrainConfig:
    return TrainConfig(
        steps=steps,
        batch_size=batch_size,
        lr=2e-3,
        schedule="cosine",
        warmup=100,
        weight_decay=0.01,
        eval_every=300,
        checkpoint_every=300,
        log_every=10,
        seed=0,
    )


def run_date_demo(
    out_dir: str | Path = "runs/demo",
    *,
    retrain: bool = False,
    steps: int = 1200,
    batch_size: int = 128,
    n_test: int = 2000,
    num_beams: int = 4,
    progress: bool = True,
) -> dict:
    """Train (or reuse) the date model in ``out_dir``, evaluate it, draw its attention."""
    out = Path(out_dir)
    task = make_seq2seq_task("dates", seed=0, n_test=n_test)
    best = out / "best"
    started = time.perf_counter()
    trained = retrain or not (best / "config.json").is_file()
    if trained:
        torch.manual_seed(0)
        model = Transformer(demo_model_config(task))
        print(
            f"Training a {sum(p.numel() for p in model.parameters()):,}-parameter Transformer "
            f"on generated dates ({len(task.test)} held-out test dates) ..."
        )
        if retrain and (out / "metrics.jsonl").exists():
            (out / "metrics.jsonl").unlink()
        trainer = Trainer(
            model,
            task,
            demo_train_config(steps, batch_size),
            out_dir=out,
            save_info={
                "model_type": "transformer",
                "model_config": model.config.to_dict(),
                "extra": {
                    "task": "dates",
                    "seed": 0,
                    "src_chars": task.src_vocab.chars,
                    "tgt_chars": task.tgt_vocab.chars,
                },
            },
            metric="valid_exact_match",
            higher_is_better=True,
            d_model=128,
            progress=progress,
        )
        print(time_estimate(trainer.estimate_step_seconds(), steps))
        trainer.fit()
    else:
        print(f"Reusing the trained model in {best} (pass --retrain to train again).")
    model, _ = load_model(best)
    train_seconds = time.perf_counter() - started

    t0 = time.perf_counter()
    greedy = exact_match(task, model, task.test)
    greedy_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    beam = exact_match(task, model, task.test, num_beams=num_beams)
    beam_seconds = time.perf_counter() - t0

    print(
        f"\nExact match on {len(task.test)} held-out dates: greedy {greedy:.2%}, "
        f"beam search ({num_beams} beams) {beam:.2%}"
    )
    print("\nSome translations:")
    inputs = list(DEMO_EXAMPLES) + [s for s, _ in task.test[:4]]
    for text, iso in zip(inputs, task.translate(model, inputs)):
        print(f"  {text!r:42} -> {iso}")
    pictures = _draw_cross_attention(task, model, inputs[:3], out)
    results = {
        "test_examples": len(task.test),
        "greedy_exact_match": greedy,
        "beam_exact_match": beam,
        "num_beams": num_beams,
        "trained_now": trained,
        "train_and_load_seconds": train_seconds,
        "greedy_eval_seconds": greedy_seconds,
        "beam_eval_seconds": beam_seconds,
        "pictures": [str(p) for p in pictures],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nCross-attention heatmaps: {', '.join(str(p) for p in pictures)}")
    print(f"Everything is in {out}/ (checkpoint best/ and last/, metrics.jsonl, results.json).")
    return results


def _run_demo(args: argparse.Namespace) -> int:
    if args.intro:
        run_attention_demo()
        return 0
    run_date_demo(args.out, retrain=args.retrain, steps=args.steps, batch_size=args.batch_size)
    return 0


def _draw_cross_attention(
    task: Seq2SeqTask, model: Transformer, texts: list[str], out: Path
) -> list[Path]:
    """Heatmaps of the last decoder layer's cross-attention, one panel per head."""
    paths = []
    last = f"decoder.layers.{len(model.decoder.layers) - 1}.cross_attn"
    for i, (text, iso) in enumerate(zip(texts, task.translate(model, texts))):
        b = task.encode([(text, iso)])
        with torch.no_grad():
            _, weights = capture_attention(model, lambda b=b: model(b.src, b.tgt_in), [last])
        out_tokens = ["<bos>", *iso]
        paths.append(
            plot_attention_heads(
                weights[last][0, :, : len(out_tokens)],
                out_tokens,
                list(text),
                out / f"cross_attention_{i}.png",
                title=f"{text!r} -> {iso} (last decoder layer)",
                cols=2,  # two panels a row: the figure stays narrow, its labels readable
            )
        )
    return paths


def run_attention_demo() -> None:
    """Print what attention does on a tiny example, and show that the backends agree."""
    torch.manual_seed(0)
    B, H, L, D = 2, 4, 6, 16
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    lengths = torch.tensor([6, 4])
    mask = combine_masks(causal_mask(L), padding_mask(lengths)[:, None, None, :])
    print("Causal mask (True = may attend), 6 x 6:")
    print(causal_mask(L).int())
    print("\nCausal + padding mask of the second sequence (length 4):")
    print(mask[1, 0].int())

    out, weights = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    print("\nAttention weights of sequence 2, head 0 (rows sum to 1):")
    print(weights[1, 0].round(decimals=2))
    print("\nThe three backends agree (max |difference| to math):")
    for backend in ("flash", "fused"):
        other = scaled_dot_product_attention(q, k, v, mask, backend=backend)
        print(f"  {backend:5s}: {(other - out).abs().max().item():.2e}")

    mha = MultiHeadAttention(embed_dim=32, num_heads=8, num_kv_heads=2)
    x = torch.randn(B, L, 32)
    y, w = mha(x, is_causal=True, key_mask=padding_mask(lengths), return_weights=True)
    print(
        f"\nGrouped-query MultiHeadAttention (8 query heads, 2 key/value heads): "
        f"{tuple(x.shape)} -> {tuple(y.shape)}, weights {tuple(w.shape)}"
    )
