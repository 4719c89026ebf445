"""What tests, benchmarks and the demo share: tiny models, the browser helper, the GPU check,
emulated hosts. Never imported by the rest of the library.
"""
