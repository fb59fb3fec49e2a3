"""The package of the gRPC modules generated from proto/ (`epdserve.proto_gen.epdserve.v1`), and
`codegen`, which makes them.

An installed wheel holds the generated tree here (built by setup.py); a source checkout's tree
lives in a per-interpreter cache folder, generated on first import, which this package's
`__path__` puts first (codegen's docstring says how). Import the generated modules from
`epdserve.rpc`, never from here.
"""
from epdserve.proto_gen.codegen import package_path

__path__ = package_path(__path__)
