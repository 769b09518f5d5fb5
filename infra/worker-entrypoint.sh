#!/usr/bin/env bash
# Prefect worker for NECTAR: wait for the server, (re)register the deployments, then poll the pool.
# Every setting comes from the environment (docker-compose.yml / .env); see .env.example.
set -euo pipefail

: "${PREFECT_API_URL:?PREFECT_API_URL must point at the Prefect server, e.g. http://prefect-server:4200/api}"
POOL="${NECTAR_WORK_POOL:-nectar}"
DATA="${NECTAR_DATA_DIR:-/data}"
mkdir -p "$DATA" "${NECTAR_CACHE:-/cache/nectar}"

echo "waiting for the Prefect API at $PREFECT_API_URL ..."
for _ in $(seq 1 120); do
  if curl -fsS "$PREFECT_API_URL/health" >/dev/null 2>&1; then break; fi
  sleep 2
done
curl -fsS "$PREFECT_API_URL/health" >/dev/null || { echo "Prefect API not reachable at $PREFECT_API_URL" >&2; exit 1; }

if [ "${NECTAR_DEPLOY_ON_START:-1}" = "1" ]; then
  # Idempotent: creates or updates the pool, the gpu queue, the nectar-gpu limit and the deployments.
  # --llm-from-env points every LLM role at NECTAR_LLM_BASE_URL / NECTAR_JUDGE_BASE_URL.
  nectar deploy \
    --pool "$POOL" \
    --preset "${NECTAR_PRESET:-cpu}" \
    --working-dir "$DATA" \
    --gpus "${NECTAR_GPUS:-1}" \
    --llm-from-env
fi

exec prefect worker start --pool "$POOL" --type process \
  --name "${NECTAR_WORKER_NAME:-$(hostname)}" \
  --limit "${NECTAR_WORKER_LIMIT:-2}"
