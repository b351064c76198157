#!/usr/bin/env bash
# `make demo`: SQLite, eager Celery, a simulated fleet, the site on http://127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT=${PORT:-8000}
URL="http://127.0.0.1:${PORT}"
FLEET=${FLEET:-h200,rtx-pro-6000,2x-rtx-5090,2x-rtx-4090,2x-rtx-4090-wsl2,m4-max-llamacpp}
STATE=${DEMO_STATE_DIR:-var/demo}
mkdir -p "$STATE/log"
unset REDIS_URL CELERY_BROKER_URL
export DEBUG=${DEBUG:-1}

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null; then
  echo "Port ${PORT} is taken: stop what runs there or run 'PORT=8001 make demo'." >&2
  exit 1
fi

$PY manage.py migrate --noinput -v0
$PY manage.py demo_setup --machines "$FLEET" --state-dir "$STATE/fleet" \
  --tokens-file "$STATE/tokens"

$PY -m uvicorn config.asgi:application --host 127.0.0.1 --port "$PORT" --log-level warning \
  --timeout-graceful-shutdown 3 &
pids+=($!)
names=(site)
for _ in $(seq 1 100); do
  (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null && break
  kill -0 "${pids[0]}" 2>/dev/null || { echo "The site did not start (uvicorn exited)." >&2; exit 1; }
  sleep 0.2
done

$PY manage.py run_schedule >"$STATE/log/schedule.log" 2>&1 &
pids+=($!)
names+=("periodic tasks (see $STATE/log/schedule.log)")
# The engines take free ports, never the site's. "--tokens=": a list of "-" (machines
# enrolled before) must not read as an option. Each agent runs its engine itself, as its child,
# the way `python -m agent run --engine-command ...` does on a provider's machine, so that
# verification can switch it to the platform's yardstick and back.
started=$(date +%s)
$PY -m fleetsim up --platform "$URL" --profiles "$FLEET" --tokens="$(cat "$STATE/tokens")" \
  --state-dir "$STATE/fleet" --agent-engines all >"$STATE/log/fleet.log" 2>&1 &
pids+=($!)
names+=("simulated fleet (see $STATE/log/fleet.log)")
out=$($PY manage.py demo_setup --machines "$FLEET" --state-dir "$STATE/fleet" --list \
  --since "$started" --fleet-pid "${pids[2]}" --fleet-log "$STATE/log/fleet.log")
grep -v '^DEMO_API_KEY=' <<<"$out" || true
key=$(sed -n 's/^DEMO_API_KEY=//p' <<<"$out")
model=$($PY manage.py demo_models | sed -n 's/^DEMO_MODEL=//p' | head -1)

cat <<BANNER

  Rigshare is running on ${URL}  (Ctrl-C stops everything)

  Log in as:
    alice@rigshare.test / demo-alice-2026   renter, \$50 of credit, renting a 4090 by the second
    bob@rigshare.test   / demo-bob-2026     provider of the simulated fleet
    carol@rigshare.test / demo-carol-2026   API consumer, \$20 of credit; her API key (shown once):
        ${key}
    admin@rigshare.test / demo-admin-2026   operator: ${URL}/admin/

  OpenAI-compatible API: ${URL}/v1  (model ${model}; the fleet serves it once verification
  has measured its cards, a few minutes after start; until then /v1 answers 503)
    curl ${URL}/v1/chat/completions -H "Authorization: Bearer ${key}" \\
      -H "Content-Type: application/json" \\
      -d '{"model": "${model}", "messages": [{"role": "user", "content": "Hello"}], "stream": true}'
    Metrics: ${URL}/metrics

  REST API docs: ${URL}/api/docs/     Logs: ${STATE}/log/
BANNER
# Whichever part stops first ends the demo. Ctrl-C reaches them too and they stop cleanly
# (status 0; bash leaves the signal to them); any other end is said, with the part's name.
set +e
wait -n "${pids[@]}"
status=$?
[ "$status" = 0 ] && exit 0
for i in "${!pids[@]}"; do
  kill -0 "${pids[$i]}" 2>/dev/null || { echo "The ${names[$i]} stopped (status ${status}); stopping the demo." >&2; break; }
done
exit 1
