// Package kvindex is the control plane's global KV index: which worker holds which prompt
// block, in which storage tier, built from the KV events every engine publishes.
//
// Blocks are keyed by kvrelay's own chained sequence hash (package engines/blockhash),
// recomputed from the token ids each BlockStored event carries, so that a prompt the proxy
// hashes finds the blocks of every engine, whatever hash function the engine uses. Per
// worker, the engine's own block hashes map to sequence hashes so that BlockRemoved events
// (hashes only) resolve.
//
// The blocks and their holders live in a blockset.Set (package xds/blockset): each block once,
// naming a holder set that every block with the same holders shares, so a longest-prefix query
// walks the prompt's chain once, one map lookup per block, whatever the number of workers.
package kvindex
