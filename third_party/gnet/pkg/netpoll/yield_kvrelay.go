// Copyright (c) 2026 the kvrelay authors
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

//go:build linux

package netpoll

import "sync/atomic"

// yieldMinEvents is how many events the last non-empty poll must have returned for a
// poller to yield (runtime.Gosched) after an empty non-blocking poll, before it blocks in
// epoll_wait. Upstream gnet always yields (1). A loop locked to its thread pays for each yield
// with a hand-off to another thread and back, which doubles the latency of a lone request;
// after a busy batch the yield still pays, as a short pause that lets the next batch build up.
var yieldMinEvents atomic.Int32

func init() { yieldMinEvents.Store(1) }

// SetYieldMinEvents sets, for pollers started after the call, how many events the last
// non-empty poll must have returned for the poller to yield after an empty one (1: always,
// as upstream gnet does).
func SetYieldMinEvents(n int) {
	if n < 1 {
		n = 1
	}
	yieldMinEvents.Store(int32(n))
}
