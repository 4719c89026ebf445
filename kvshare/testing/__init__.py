"""What tests, benchmarks and the demo share: tiny models, local clusters, emulated hosts, browser helper, the GPU check (never imported by the rest of the library)."""
