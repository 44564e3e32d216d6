// Package prefix holds the proxy's view of which worker caches which prompt blocks: the
// Index interface the router queries, and Approx, the approximate index a proxy keeps on its
// own when no control plane feeds it the engines' KV events.
//
// Blocks are named by the chained sequence hashes of package engines/blockhash, so a worker
// that holds block i of a prompt also holds, as far as any index can tell, the blocks before
// it: a lookup walks the prompt's chain from the start and a worker's overlap is the number of
// leading blocks it holds.
package prefix
