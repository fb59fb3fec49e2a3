"""An E engine and a P engine that exchange features only through a 3-master Redis Cluster of real
redis-server processes (test_mm_engine.py's `Stages`): a master dies mid-run and every output
still equals transformers' greedy generate; the features it held are recomputed by P."""
import pytest

from epdserve.model.reference import ReferenceGenerator
from epdserve.transfer.mm_store import RedisConnection, RedisMMStore
from tests.tools import require_tool
from tests.transfer.redis_topologies import RedisClusterProcesses
from tests.transfer.test_mm_engine import PH, SP, Stages, _image

require_tool("redis-server", "redis-cli", why="Debian's redis-server package", module=True)


@pytest.mark.timeout(300)
def test_engines_over_the_cluster_answer_exactly_with_a_master_killed(qwen2_5_vl_tiny):
    """E and P engines exchange features only through the cluster; the master that would hold
    request r2's feature dies before r2 arrives: E cannot store it, P recomputes it (and whatever
    else the store's backoff turns into misses), outputs stay exact."""
    with RedisClusterProcesses(masters=3) as cluster:
        store = RedisMMStore(cluster.url(), connection=RedisConnection(cluster.url(), backoff_s=0.1,
                                                                       max_backoff_s=0.2))
        st = Stages(qwen2_5_vl_tiny, store)
        imgs = [_image(40 + i) for i in range(5)]
        prompts = [f"picture {i}: {PH}" for i in range(5)]
        outs = {}
        try:
            for i in range(5):
                if i == 2:  # kill the master that would hold this feature: E cannot store it, P recomputes it
                    node = store.connection.client.get_node_from_key(store.redis_key(st.key(imgs[i])))
                    cluster.kill(cluster.ports.index(node.port))
                st.encode(f"r{i}", prompts[i], [imgs[i]])
                outs[i] = st.prefill_decode(f"r{i}", prompts[i], [imgs[i]])
        finally:
            st.close()
            store.close()
    ref = ReferenceGenerator(qwen2_5_vl_tiny)
    for i, out in outs.items():
        assert out.token_ids == ref.generate(prompts[i], [imgs[i]], SP.max_tokens), i
    p = st.p_prov.stats()
    assert st.p.encoder.recomputes >= 1, p  # at least r2's
    assert p.hits_local + p.hits_store >= 2, p  # r0, r1 came from the cluster
