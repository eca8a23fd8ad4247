import json, statistics, sys
metrics = ["load 1 min","ack p50 ms","ack p99 ms","ack p99.9 ms","commit->claim start p50 ms","claim p50 ms","publish p50 ms","cycle: completion p50 ms","cycle: empty claim p50 ms"]
for mode in ["force_custom_plan","force_generic_plan","auto"]:
    samples = {m: [] for m in metrics}
    for p in (1,2):
        d = json.load(open(f"latency-{mode}-{p}.json"))
        for r in d["reports"]:
            for f in r["figures"]:
                if f["metric"] in samples: samples[f["metric"]] += f["samples"]
    print(mode, " | ".join(f"{m}: {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for m, v in samples.items()))
for mode in ["force_custom_plan","force_generic_plan","auto"]:
    out = {}
    for p in (1,2):
        d = json.load(open(f"drain-{mode}-{p}.json"))
        for r in d["reports"]:
            for f in r["figures"]:
                if f["metric"] == "events/s": out.setdefault(f["contender"], []).extend(f["samples"])
    print(mode, " | ".join(f"{c[:40]}: {statistics.median(v):.0f} [{min(v):.0f}-{max(v):.0f}]" for c, v in out.items()))
