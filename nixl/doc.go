// Package nixl moves KV cache blocks between processes, in the manner of NVIDIA NIXL: an
// Agent registers memory regions, publishes metadata describing them and the backends it
// speaks, loads its peers' metadata, and runs one-sided READ and WRITE transfers between
// lists of local and remote descriptors, each optionally followed by a notification
// delivered to the peer. kvrelay's simulated engine uses it for disaggregated serving: the
// prefill role registers its KV block storage, the decode role connects to the prefill
// worker's address from vLLM's kv_transfer_params, READs the listed blocks into its own
// slots and notifies the prefill role, which then frees them.
//
// # Lifecycle
//
//	a, err := nixl.NewAgent("decode-0", nixl.Config{ListenAddr: "127.0.0.1:0"})
//	mem, err := nixl.AllocHostMem(slots * blockSize) // shareable host memory
//	kv, err := a.RegisterHostMem(mem, nixl.WithRegionName("kv"))
//	peer, err := a.Connect(ctx, "10.0.0.7:5600")     // fetch and load the peer's metadata
//	md, _ := a.RemoteMD(peer)
//	theirs, _ := md.Region("kv")
//	remote, _ := theirs.Blocks(blockSize, remoteBlockIDs)
//	local, _ := kv.Blocks(blockSize, localBlockIDs)
//	err = a.Transfer(ctx, nixl.Read, local, peer, remote, nixl.WithNotif(msg))
//	...
//	a.Close(); mem.Free()
//
// Transfers can also be prepared once (CreateXfer), posted repeatedly (Post), polled
// (State) and awaited (Wait). Metadata can be exchanged out of band instead of with
// Connect: GetLocalMD on one side, LoadRemoteMD on the other.
//
// # Backends
//
// TCP (always on) keeps one persistent connection per pair of agents, multiplexes
// requests on it by id, sends payload with vectored writes straight from registered
// memory and receives it straight into registered memory. Shared memory (Linux) serves
// same-host peers: regions allocated with AllocHostMem are memory files that the peer
// maps, so a transfer is a memcpy in the initiator with no work in the target. The agent
// picks, per transfer, the first backend in Config.Backends that both sides speak and that
// can carry the transfer. Backends implement the Backend interface, so a binding to the
// NIXL library itself can be added without changing callers.
//
// # Errors
//
// Descriptors are checked before any byte moves; rejections are *DescError values
// wrapping ErrUnknownRegion, ErrOutOfRange, ErrLengthMismatch or ErrInvalidDesc. A lost
// peer fails its transfers with ErrPeerGone, a slow one with ErrTimeout; see errors.go for
// the full list. Every error is matched with errors.Is.
//
// Device (VRAM) memory is not supported: it is rejected with ErrDeviceMemoryUnavailable.
package nixl
