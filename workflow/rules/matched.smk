# E1 (matched): live vs prefill of the identical prefix at one precision, each with exact replicas.


def matched_tables():
    precision = MATCHED["precision"]
    return [
        table
        for replica in range(MATCHED["replicas"])
        for shard in SHARDS
        for table in (
            live_table(PRIMARY, precision, replica, shard),
            rebuilt_table(PRIMARY, precision, precision, "prefill", replica, shard),
        )
    ]
