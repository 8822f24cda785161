"""What a running server publishes to Prometheus, through ``prometheus_client``.

``histograms``: the distributions the serving path observes (fetch, restore, store, writer
queue, time to first token, cached tokens, the fetch plan); a leaf module any stage may call.
``families``: the stats dicts' counters and gauges under Prometheus names, with labels and HELP
text. ``exposition``: one server's registry (both of them) and its text.
"""
