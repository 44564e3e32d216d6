package nixl_test

import (
	"context"
	"fmt"
	"log"

	"github.com/kvrelay/kvrelay/nixl"
)

// The decode role of disaggregated serving fetches a request's KV blocks from the prefill
// worker named in vLLM's kv_transfer_params (remote_host, remote_port, remote_block_ids)
// and tells it to free them.
func Example() {
	const blockSize, slots = 16 << 10, 64
	ctx := context.Background()

	// Prefill worker: KV block storage, one region of fixed-size slots.
	prefillMem, err := nixl.AllocHostMem(slots * blockSize)
	if err != nil {
		log.Fatal(err)
	}
	defer prefillMem.Free()
	prefill, err := nixl.NewAgent("prefill-0", nixl.Config{ListenAddr: "127.0.0.1:0"})
	if err != nil {
		log.Fatal(err)
	}
	defer prefill.Close()
	if _, err := prefill.RegisterHostMem(prefillMem, nixl.WithRegionName("kv")); err != nil {
		log.Fatal(err)
	}
	copy(prefillMem.Bytes()[7*blockSize:], "block seven")

	// Decode worker: its own slots, and only the prefill worker's address.
	decodeMem, err := nixl.AllocHostMem(slots * blockSize)
	if err != nil {
		log.Fatal(err)
	}
	defer decodeMem.Free()
	decode, err := nixl.NewAgent("decode-0", nixl.Config{})
	if err != nil {
		log.Fatal(err)
	}
	defer decode.Close()
	mine, err := decode.RegisterHostMem(decodeMem)
	if err != nil {
		log.Fatal(err)
	}

	peer, err := decode.Connect(ctx, prefill.Addr()) // remote_host:remote_port
	if err != nil {
		log.Fatal(err)
	}
	md, _ := decode.RemoteMD(peer)
	kv, _ := md.Region("kv")
	remote, err := kv.Blocks(blockSize, []int{3, 7, 9}) // remote_block_ids
	if err != nil {
		log.Fatal(err)
	}
	local, err := mine.Blocks(blockSize, []int{0, 1, 2})
	if err != nil {
		log.Fatal(err)
	}
	if err := decode.Transfer(ctx, nixl.Read, local, peer, remote, nixl.WithNotif([]byte("free 3,7,9"))); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s\n", decodeMem.Bytes()[blockSize:blockSize+11])

	// Prefill learns the blocks were read and may free them.
	notifs, err := prefill.WaitNotifs(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s: %s\n", "decode-0", notifs["decode-0"][0])
	// Output:
	// block seven
	// decode-0: free 3,7,9
}
