"""Running a whole elastic job on one machine: etcd members and torchrun nodes as real
processes, each node its own process group, all of it killable, freezable and
cleanly removable. Used by the chaos harness, the benchmarks and the tests.
"""
