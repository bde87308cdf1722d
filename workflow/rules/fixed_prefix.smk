# E2 (fixed_prefix): the E1 live prefix is never regenerated; each construction
# rebuilds its boundary state at each precision (the fp32 arm upcasts the same
# checkpoint). A table shared with E1 (prefill at the E1 precision) is one job.


def fixed_prefix_tables():
    return [
        rebuilt_table(PRIMARY, MATCHED["precision"], precision, construction, 0, shard)
        for precision in FIXED["precisions"]
        for construction in CONSTRUCTIONS
        for shard in SHARDS
    ]
