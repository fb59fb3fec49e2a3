"""One role parser: the engine's config, the instance's config and the registry accept and
refuse the same role strings (no model is loaded)."""
import pytest

from epdserve.engine.config import EngineConfig
from epdserve.roles import ROLES, normalize_roles
from epdserve.instance.config import InstanceConfig
from epdserve.rpc import common_pb2
from epdserve.scheduler.registry import InstanceRegistry, RegistryError

BAD = ("", "X", "EX", "EPX", "EE", "E,P", "PDD", "E+P", "P+D", "P+")


def test_normalize_roles_canonical_order():
    assert normalize_roles("pe") == "EP"
    assert normalize_roles(" DPE ") == "EPD"
    assert normalize_roles("dp") == "PD"
    assert normalize_roles(" p + e ") == "P+E" and EngineConfig(model="unused", roles="P+E").encodes
    assert not EngineConfig(model="unused", roles="P+E").decodes
    assert sorted(normalize_roles(r) for r in ROLES) == sorted(ROLES)
    for bad in BAD:
        with pytest.raises(ValueError, match="roles must be one of"):
            normalize_roles(bad)


@pytest.mark.parametrize("bad", BAD)
def test_every_config_refuses_what_the_parser_refuses(bad):
    with pytest.raises(ValueError, match="roles must be one of"):
        EngineConfig(model="unused", roles=bad)  # "EX" used to become "E" here
    with pytest.raises(ValueError, match="roles must be one of"):
        InstanceConfig(roles=bad, model="unused")
    status = common_pb2.InstanceStatus(instance_id="i", roles=bad, address="127.0.0.1:1")
    with pytest.raises(RegistryError, match="roles must be one of"):
        InstanceRegistry().register(status)


def test_every_config_normalizes_alike():
    assert EngineConfig(model="unused", roles="pe").roles == "EP"
    assert InstanceConfig(roles="pe", model="unused").roles == "EP"
    status = common_pb2.InstanceStatus(instance_id="i", roles="pe", address="127.0.0.1:1")
    assert InstanceRegistry().register(status).roles == "EP"
