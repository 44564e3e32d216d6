// Package latency predicts what a worker will make a request wait: its time to first token
// (the wait for a free sequence slot, the prefill backlog ahead of it, its own uncached
// prefill) and the time between its tokens once it runs, from the worker's load, its
// scheduler limits and a prior step-time curve, corrected online by recursive least squares
// from what the worker actually did.
//
// The router (dataplane/route) keeps one Model per worker. Predict runs on the proxy's event
// loops for every candidate of every request and reads only atomics: one published fit of
// the model, whole, through a sequence lock. ObserveTTFT and ObserveDecode run when a
// request's first token arrives and when it finishes, take the model's mutex and publish the
// new fit. Nothing here allocates.
package latency
