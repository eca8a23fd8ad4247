import json, statistics
metrics = ["load 1 min","ack p50 ms","ack p99 ms","ack p99.9 ms","commit->claim start p50 ms","claim p50 ms","publish p50 ms","cycle: claim p50 ms","cycle: completion p50 ms","cycle: empty claim p50 ms","tail 1%: commit->claim start p50 ms"]
res = {}
for v in ["old","new"]:
    samples = {m: [] for m in metrics}
    for p in (1,2,3):
        d = json.load(open(f"latency-{v}-{p}.json"))
        for r in d["reports"]:
            for f in r["figures"]:
                if f["metric"] in samples: samples[f["metric"]] += f["samples"]
    res[v] = samples
for m in metrics:
    o, n = res["old"][m], res["new"][m]
    mo, mn = statistics.median(o), statistics.median(n)
    print(f"{m:40s} old {mo:8.2f} [{min(o):.2f}-{max(o):.2f}]  new {mn:8.2f} [{min(n):.2f}-{max(n):.2f}]  ratio {mn/mo if mo else 0:.2f}")
for v in ["old","new"]:
    d = json.load(open(f"drain-{v}.json"))
    for r in d["reports"]:
        for f in r["figures"]:
            if f["metric"] == "events/s":
                print(v, f"{f['contender'][:55]:55s} {f['median']:8.0f} [{f['min']:.0f}-{f['max']:.0f}] ratio {f['ratio']}")
