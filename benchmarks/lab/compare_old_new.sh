# old main (.old, the session's starting commit) against new main (the working tree), interleaved
set -u
MODELS=${MODELS:-smollm2,llama8b}; STEPS=${STEPS:-64}
for round in $(seq 1 ${ROUNDS:-2}); do
  order="old new"; [ $round = 2 ] && order="new old"     # ABBA: no side always runs second
  for code in $order; do
    dir=.; [ $code = old ] && dir=.old
    echo "=== $code round $round"
    PYTHONPATH=$dir timeout ${PER:-280} python $dir/benchmarks/cuda_llm.py --models $MODELS --steps $STEPS --json $OUT/${code}_$round.json 2>&1 | grep -v Warning | tail -4
  done
done
python - <<'PY'
import json, glob, os
out = os.environ["OUT"]
rows = {}
for f in sorted(glob.glob(f"{out}/*_*.json")):
    code = os.path.basename(f).split("_")[0]
    data = json.load(open(f))
    for r in (data if isinstance(data, list) else data.get("results", [])):
        if "replay_us" in r:
            rows.setdefault(r["model"], {}).setdefault(code, []).append((r["replay_us"], r["tok_s"]))
for model, d in rows.items():
    old, new = d.get("old", []), d.get("new", [])
    if old and new:
        bo, bn = min(x[0] for x in old), min(x[0] for x in new)
        to, tn = max(x[1] for x in old), max(x[1] for x in new)
        print(f"{model}: replay old {bo} us new {bn} us (new/old {bn/bo:.3f}); exe.run tok/s old {to} new {tn} (new/old {tn/to:.3f})")
PY
