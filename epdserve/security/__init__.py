"""Who may call what: the API key of the public services, the cluster token of the internal
ones, and TLS.

- `secrets`: where keys and tokens come from (flags, files, environment) and how they are
  compared; they are never logged.
- `interceptors`: gRPC server interceptors that check them (asyncio and threaded servers) and
  client interceptors that send them.
- `tls`: server and channel credentials from PEM files.
- `channels`: client channels to a (possibly secured) server: TLS and the key / token as metadata.
- `options`: `SchedulerSecurity` / `InstanceSecurity`, what one process checks and presents.
- `exposure`: who can reach a listener, and the refusal to open one beyond loopback without a credential.
- `tenants`: the tenant each client key names (a keys file, reloaded on SIGHUP, and the single
  key), and the cache salt of a tenant's requests.

Metadata: the API key as ``authorization: Bearer <key>`` (what OpenAI clients send over HTTP);
the cluster token as ``epdserve-cluster-token: <token>``, which every instance presents to the
scheduler's Registry and the scheduler presents on every call to an instance.
"""
from epdserve.security.secrets import API_KEY_ENV, CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER, Secret

__all__ = ["API_KEY_ENV", "CLUSTER_TOKEN_ENV", "CLUSTER_TOKEN_HEADER", "Secret"]
