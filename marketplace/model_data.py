"""config.json fields of the models Rigshare knows by name, with where each came from.

Verification's first-principles serving prediction reads these (through
`marketplace.modelmath.architecture_for`). A model that is not here is still verified: by its
fleet peers, by the size its name states, or, with neither, by measurement alone.
"""

from marketplace import modelmath

_QWEN35_27B = dict(
    # Qwen3.5-27B: 64 layers, three Gated DeltaNet (linear-attention) layers to one full
    # attention layer, so 16 layers keep a per-token KV cache; GQA with 4 KV heads of 256.
    num_hidden_layers=64, hidden_size=5120, num_attention_heads=24, num_key_value_heads=4,
    head_dim=256, intermediate_size=17408, vocab_size=248320, full_attention_interval=4,
)

MODELS = {
    # The 27B hybrid of the published fleet measurements (FACTS.md), under the id the fleet
    # simulator serves it by and under its own.
    "Qwen/Qwen3-27B": dict(config=_QWEN35_27B, params=27e9,
                           source="Qwen3.5-27B config.json (THUDM/slime's model arguments); "
                                  "27B parameters as its model card states"),
    "Qwen/Qwen3.5-27B": dict(config=_QWEN35_27B, params=27e9,
                             source="Qwen3.5-27B config.json; 27B parameters (model card)"),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        config=dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                    vocab_size=128256),
        params=8.03e9, source="Llama-3.1-8B config.json (FACTS.md: 128 KiB of KV per token)"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(
        config=dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152, tie_word_embeddings=True),
        params=134.5e6, source="SmolLM2-135M config.json (the test engine's model)"),
}
ALIASES = {
    "meta-llama/Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def architecture_for(model_id: str) -> modelmath.Architecture | None:
    """The known architecture of an engine's model id (case and organisation aside)."""
    wanted = (model_id or "").strip().lower()
    names = {name.lower(): name for name in MODELS} | {
        alias.lower(): target for alias, target in ALIASES.items()}
    name = names.get(wanted) or next(
        (target for key, target in names.items() if key.rsplit("/", 1)[-1] == wanted
         .rsplit("/", 1)[-1]), None)
    if name is None:
        return None
    row = MODELS[name]
    return modelmath.from_config(row["config"], params=row["params"], source=row["source"])
