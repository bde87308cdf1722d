# E3 (bridge): at each precision, feed the live prefix token by token and compare
# the cache bit for bit with the retained live cache of that precision. At the
# E1 precision both tables already exist (E1 live, E2 incremental).


def bridge_tables():
    return [
        table
        for precision in FIXED["precisions"]
        for shard in SHARDS
        for table in (
            live_table(PRIMARY, precision, 0, shard),
            rebuilt_table(PRIMARY, precision, precision, "incremental", 0, shard),
        )
    ]
