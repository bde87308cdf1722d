"""summary.json before (old E5/E1 shapes) vs after (one x/N shape): every old value is found, unchanged, under its new key."""

import json
import sys

old = json.load(open(sys.argv[1]))
new = json.load(open(sys.argv[2]))
problems = []
for name, e1 in old["E1"]["checkpoints"].items():
    n1 = new["E1"]["checkpoints"][name]
    for side in ("live", "prefill"):
        if (
            e1["unparsable_proportion"][side] != n1["unparsable"][side]
            or e1["unparsable"][side] != n1["unparsable"][side]["count"]
        ):
            problems.append(f"E1 {name} unparsable {side}")
    rest_old = {k: v for k, v in e1.items() if k not in ("unparsable", "unparsable_proportion")}
    rest_new = {k: v for k, v in n1.items() if k != "unparsable"}
    if rest_old != rest_new:
        problems.append(f"E1 {name} other keys")
for key, a in old["E5"]["all_layers"].items():
    b = new["E5"]["all_layers"][key]
    if a["follows_donor"] != b["follows_donor"]:
        problems.append(f"{key} follows_donor")
    if (
        a["follows_recipient_proportion"] != b["follows_recipient"]
        or a["follows_recipient"] != b["follows_recipient"]["count"]
    ):
        problems.append(f"{key} recipient")
    if a["neither_proportion"] != b["neither"] or a["neither"] != b["neither"]["count"]:
        problems.append(f"{key} neither")
    if a["by_direction_follows_donor"] != b["by_direction"]:
        problems.append(f"{key} by_direction")
    if {d: f"{c['count']}/{c['n']}" for d, c in b["by_direction"].items()} != a["by_direction"]:
        problems.append(f"{key} by_direction text")
for a, b in zip(old["E5"]["sweep"], new["E5"]["sweep"], strict=True):
    f = b["follows_donor"]
    if (a["subset"], a["layers"], a["kv"], a["positions"]) != (b["subset"], b["layers"], b["kv"], b["positions"]):
        problems.append("sweep ids")
    if (a["follows_donor"], a["n"], a["fraction"], a["wilson95"]) != (f["count"], f["n"], f["rate"], f["wilson95"]):
        problems.append(f"sweep {a['subset']}")
for key in set(old["E5"]) - {"all_layers", "sweep"}:
    if old["E5"][key] != new["E5"].get(key):
        problems.append(f"E5 {key}")
for key in set(old) | set(new):
    if key not in ("E1", "E5") and old.get(key) != new.get(key):
        problems.append(key)
print("\n".join(problems) or "every value of the old summary.json is in the new one, unchanged")
sys.exit(1 if problems else 0)
