#!/usr/bin/env bash
# A real Prometheus scrapes a running `tokenmill serve --metrics-prefix vllm:`,
# then the PromQL queries of vLLM's Grafana dashboard must return data.
#
#   tokenmill serve --metrics-prefix vllm: --port 8000 &     # then send it some requests
#   bash benchmarks/prometheus_check.sh [http://127.0.0.1:8000]
#
# Needs Debian's prometheus (`apt-get update; apt-get install -y prometheus`).
# Prometheus runs on 127.0.0.1:9095 with its data in a temporary folder, and
# is stopped at the end. Exits 1 if a query comes back empty.
set -euo pipefail

TARGET=${1:-http://127.0.0.1:8000}
PROM_PORT=${PROM_PORT:-9095}
HOSTPORT=${TARGET#http://}
WORK=$(mktemp -d)
PROM=http://127.0.0.1:$PROM_PORT

command -v prometheus >/dev/null || { echo "prometheus is not installed (apt-get install -y prometheus)"; exit 2; }
curl -sf "$TARGET/metrics" | grep -q '^vllm:' || {
    echo "$TARGET/metrics has no vllm: names; start the server with --metrics-prefix vllm:"; exit 2; }

cat > "$WORK/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: tokenmill
    static_configs:
      - targets: ["$HOSTPORT"]
EOF
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/data" \
    --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
trap 'kill $PROM_PID 2>/dev/null; wait $PROM_PID 2>/dev/null; rm -rf "$WORK"' EXIT

# Wait for a few scrapes (rate() needs two samples in its window).
for _ in $(seq 60); do
    up=$(curl -s "$PROM/api/v1/query" --data-urlencode 'query=up{job="tokenmill"}' \
         | python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' 2>/dev/null || true)
    [ "$up" = "1" ] && break
    sleep 1
done
[ "$up" = "1" ] || { echo "Prometheus could not scrape $TARGET"; cat "$WORK/prometheus.log"; exit 1; }
sleep "${SETTLE_S:-8}"

# Queries from vLLM's example Grafana dashboard (examples/observability), with
# its $model_name variable filled by a regex that matches any.
QUERIES=(
  'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name=~".+"}[1m])))'
  'rate(vllm:prompt_tokens_total{model_name=~".+"}[1m])'
  'rate(vllm:generation_tokens_total{model_name=~".+"}[1m])'
  'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name=~".+"}[1m])))'
  'vllm:num_requests_running{model_name=~".+"}'
  'vllm:num_requests_waiting{model_name=~".+"}'
  'vllm:kv_cache_usage_perc{model_name=~".+"}'
  'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name=~".+"}[1m])))'
  'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name=~".+"}[1m]))'
  'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name=~".+"}[1m]))'
  'sum by(finished_reason) (increase(vllm:request_success_total{model_name=~".+"}[1m]))'
  'rate(vllm:request_queue_time_seconds_sum{model_name=~".+"}[1m])'
  'rate(vllm:request_prefill_time_seconds_sum{model_name=~".+"}[1m])'
  'rate(vllm:request_decode_time_seconds_sum{model_name=~".+"}[1m])'
  'sum by(le) (increase(vllm:request_params_max_tokens_bucket{model_name=~".+"}[1m]))'
  'sum by(le) (increase(vllm:request_params_n_bucket{model_name=~".+"}[1m]))'
  'histogram_quantile(0.9, sum by(le) (rate(vllm:iteration_tokens_total_bucket{model_name=~".+"}[1m])))'
  'rate(vllm:prompt_tokens_cached_total{model_name=~".+"}[1m])'
  'vllm:num_requests_waiting_by_reason{reason="capacity"}'
  'vllm:cache_config_info'
)
failed=0
for q in "${QUERIES[@]}"; do
    # Series with a number (a quantile over no requests is NaN: that is no data).
    n=$(curl -s "$PROM/api/v1/query" --data-urlencode "query=$q" | python3 -c '
import json, math, sys
r = json.load(sys.stdin)
ok = r.get("status") == "success"
print(sum(not math.isnan(float(s["value"][1])) for s in r["data"]["result"]) if ok else -1)')
    if [ "$n" -gt 0 ]; then
        printf 'ok    %3d series  %s\n' "$n" "$q"
    else
        printf 'EMPTY %3d series  %s\n' "$n" "$q"; failed=1
    fi
done
[ "$failed" = 0 ] && echo "all ${#QUERIES[@]} queries returned data" || echo "some queries returned nothing"
exit $failed
