"""``kvshare bench``: replay a workload against a live OpenAI-compatible endpoint and measure it.

- :mod:`.workload`: a trace (the simulator's readers) or a log of chat requests as requests to
  send, hash ids turned into token blocks;
- :mod:`.client`: the open-loop sender (streaming, TTFT and inter-token latency per request);
- :mod:`.tiers`: hit rate per cache tier from vLLM's ``/metrics`` (a gateway's workers');
- :mod:`.report`: percentiles, the table, the JSON object and the PNG;
- :mod:`.cli`: the ``bench`` subcommand.
"""
