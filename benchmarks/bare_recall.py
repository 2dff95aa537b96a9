"""Does a small Llama leave the chance plateau on bare key-value recall? Which init makes it?

The measurement behind the gotcha "A small Transformer trained from scratch does not learn KV
retrieval on a CPU budget" (``docs/gotchas.md``). A freshly initialized ``LlamaForCausalLM``
(2 layers, d_model 128, 4 heads) is trained on the barest associative recall: ``<s> k1 v1 k2 v2
... kn vn kq`` -> ``vq``, keys drawn without replacement from 100 key tokens, values from 100 value
tokens, the loss on the answer only. Every ``--every`` steps it prints the training loss and the
accuracy on 256 fresh prompts (chance: ``1 / pairs``).

The ``--init`` choices:

- ``hf``: the model as ``transformers`` builds it (every weight ``N(0, 0.02)``);
- ``fan-in``: every linear layer but the tied head re-drawn with torch's default ``nn.Linear``
  init (:func:`gna_lens.zoo.train.fan_in_init`);

and ``--embedding-std`` re-draws the (tied) token embeddings from ``N(0, std)``.

Usage (one CPU thread each, about a minute per 1,000 steps)::

    python benchmarks/bare_recall.py --init hf                             # stays at chance
    python benchmarks/bare_recall.py --init fan-in --embedding-std 0.3     # ~99% by step 1,000
"""

import argparse
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gna_lens.zoo.train import fan_in_init

N_KEYS = 100
N_SPECIAL = 4  # ids 0-3 are specials; 1 is the BOS


def batch(rng: random.Random, size: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` prompts ``<s> k1 v1 ... kn vn kq`` and their answers ``vq``."""
    prompts, answers = [], []
    for _ in range(size):
        keys = rng.sample(range(N_KEYS), pairs)
        values = [rng.randrange(N_KEYS) for _ in range(pairs)]
        q = rng.randrange(pairs)
        ids = [1]
        for k, v in zip(keys, values, strict=True):
            ids += [N_SPECIAL + k, N_SPECIAL + N_KEYS + v]
        prompts.append([*ids, N_SPECIAL + keys[q]])
        answers.append(N_SPECIAL + N_KEYS + values[q])
    return torch.tensor(prompts), torch.tensor(answers)


def main() -> None:
    """Train and print ``step loss accuracy seconds`` lines."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", choices=["hf", "fan-in"], default="hf")
    p.add_argument("--embedding-std", type=float, default=None, help="default: keep the init's")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    config = LlamaConfig(
        vocab_size=N_SPECIAL + 2 * N_KEYS,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    if args.init == "fan-in":
        fan_in_init(model)
    if args.embedding_std is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0, args.embedding_std)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    print(f"# {vars(args)}; chance {1 / args.pairs:.3f}")
    t0 = time.perf_counter()
    for step in range(args.steps):
        prompts, answers = batch(rng, args.batch_size, args.pairs)
        loss = torch.nn.functional.cross_entropy(model(input_ids=prompts).logits[:, -1], answers)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0 or step == args.steps - 1:
            with torch.no_grad():
                prompts, answers = batch(rng, 256, args.pairs)
                pred = model(input_ids=prompts).logits[:, -1].argmax(-1)
            acc = (pred == answers).float().mean().item()
            print(f"{step} {loss.item():.3f} {acc:.3f} {time.perf_counter() - t0:.0f}", flush=True)


if __name__ == "__main__":
    main()
