// Package clock is the data plane's time: one origin for the proxy's event loops, the router
// and the prefix index, read from the monotonic clock alone. time.Since reads one clock where
// time.Now reads two, and an event loop reads the clock at every event of every connection:
// it reads it once per event and hands that time down, so routing and indexing a request
// read no clock of their own.
package clock

import "time"

var (
	origin     = time.Now()
	wallOrigin = origin.UnixNano()
)

// Mono returns the nanoseconds since the process's clock origin, from the monotonic clock.
func Mono() int64 { return int64(time.Since(origin)) }

// Now returns the time of day in Unix nanoseconds: the wall clock at the origin plus Mono.
// Every absolute time the data plane compares comes from it, so they agree with each other;
// against the wall clock it drifts only by what the host's clock is slewed or stepped while
// the process runs.
func Now() int64 { return wallOrigin + Mono() }

// MonoAt converts now, a time of day from Now, to Mono.
func MonoAt(now int64) int64 { return now - wallOrigin }
