"""What the explain tests share: a configuration with a filter and a cost plugin, and a
system prompt long enough to be held."""

SHARED = "You are the support assistant of a very large shop. Answer briefly. " * 12

TTFT_AND_FILTER = """
scheduler:
  plugins:
    Filter:
      enabled: [least-request]
    Score:
      enabled:
        - name: estimated-ttft
          weight: 2
        - name: least-request
          weight: 1
  pluginConfig:
    - name: least-request
      args: {maxWaitingRequests: 5}
"""
