package probes

// Regenerate with `make generate` (hack/gen-ebpf.sh installs clang-14 and llvm-14 when missing).
// The committed *_bpfel.go and *_bpfel.o are what these lines produce.

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-O2 -g -Wall" -target bpfel tcpconn tcpconn.c
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-O2 -g -Wall" -target bpfel firstbyte firstbyte.c
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-O2 -g -Wall" -target bpfel listenq listenq.c
//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-O2 -g -Wall" -target bpfel runqlat runqlat.c
