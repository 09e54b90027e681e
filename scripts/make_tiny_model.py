"""Build a tiny random-weights model and a byte-level BPE tokenizer, offline.

Run with the vLLM venv's Python: `python make_tiny_model.py OUT_DIR [--moe | --trained]`,
or `python make_tiny_model.py OUT_DIR --lora-of MODEL_DIR` for a LoRA adapter of
that model (rank 8 on every layer's q_proj and v_proj, random weights, in PEFT's
format, which vLLM loads: adapter_config.json and adapter_model.safetensors).
Sizes follow docs/real-vllm.md: the CPU attention backend needs a head size of
32 or more, so hidden 128 with 4 heads. --moe makes a Mixtral (4 experts, 2
per token) instead of a Llama: under data parallelism vLLM's CPU build fails
at its first request and every engine sends ENGINE_CORE_DEAD, a real fatal
error sequence for the tests. --trained trains the Llama, on the text of the
Python standard library that runs this script (its tokenizer too), for a few
minutes on the CPU, seeded and on one thread, so that the same machine makes the
same weights: its next-token distributions are peaked as a real model's are
(the random one's are nearly uniform over its 900 tokens), so temperature,
top-p and min-p change what is sampled, as they do on real staging traffic.
"""

import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          PreTrainedTokenizerFast)

WORDS = (
    "the quick brown fox jumps over a lazy dog while engines stream tokens to "
    "frontends through sockets and every frame is recorded replayed compared "
    "hello world one two three four five six seven eight nine ten"
).split()


def synthetic():
    for i in range(4000):
        yield " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 12))


# What the trained model learns from: the standard library's own modules, in name order (text every machine
# with Python has), about 2 MB; and how long: 2048 tokens a step.
TEXT_BYTES, STEPS, BATCH, CONTEXT = 2_000_000, 700, 32, 64


def library_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        if size >= TEXT_BYTES:
            break
        text.append(path.read_text(errors="replace"))
        size += len(text[-1])
    return "".join(text)[:TEXT_BYTES]


def main(out: str, moe: bool, trained: bool = False) -> None:
    text = library_text() if trained else None
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(text.splitlines() if trained else synthetic(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if moe:
        model = MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
        if trained:
            train(model, torch.tensor(bpe.encode(text).ids))
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)


def train(model, ids) -> None:
    """Next-token training on random windows of ``ids``: seeded, on one thread, so one machine makes one
    set of weights. Prints the loss (nats per token) as it goes."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS, pct_start=0.1)
    model.train()
    for step in range(STEPS):
        starts = torch.randint(0, len(ids) - CONTEXT - 1, (BATCH,), generator=generator)
        batch = torch.stack([ids[s:s + CONTEXT + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == STEPS - 1:
            print(f"step {step}: loss {loss.item():.3f} nats/token", flush=True)
    model.eval()


def lora(out: str, base: str) -> None:
    """A random rank-8 adapter whose effect shows: lora_B is not zero (PEFT starts it at zero)."""
    import json

    from safetensors.torch import save_file

    config = json.loads((Path(base) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": heads * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    rank = 8
    torch.manual_seed(1)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for module, width in shapes.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, hidden) * 0.1
            weights[f"{name}.lora_B.weight"] = torch.randn(width, rank) * 0.1
    Path(out).mkdir(parents=True, exist_ok=True)
    save_file(weights, str(Path(out) / "adapter_model.safetensors"))
    (Path(out) / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": sorted(shapes), "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True}, indent=1))


if __name__ == "__main__":
    if "--lora-of" in sys.argv:
        lora(sys.argv[1], sys.argv[sys.argv.index("--lora-of") + 1])
    else:
        main(sys.argv[1], "--moe" in sys.argv[2:], "--trained" in sys.argv[2:])
