"""Generated Python code for the demo's IDL, `proxy/data/user_service.thrift`.

This is the only generated code committed to the repository: `thrift-sidecar demo`,
`demo-upstream` and `demo-client` must run from an installed package on a machine without the
Thrift compiler. (The tests' services are generated at build time into tests/gen instead.)
Do not edit `user_service/`; after changing the IDL, regenerate it with Thrift 0.17+:

    thrift --gen py -out /tmp/gen proxy/data/user_service.thrift
    cp /tmp/gen/user_service/{__init__,constants,ttypes,UserService}.py proxy/demo_gen/user_service/

(`tests/test_demo.py` checks that the committed code matches the IDL when `thrift` is installed.)
"""
