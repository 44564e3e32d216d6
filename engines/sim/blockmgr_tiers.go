package sim

import (
	"errors"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvrelay/kvrelay/engines/blockhash"
)

// The block manager's tiers below the GPU, pins and totals: what moves a block between tiers
// (offload on store or eviction, disk admission, onboarding costs, a disk block that fails
// its read), the pins that keep blocks, and the counters TierStats reads.

// tierCounters are the block manager's totals, read from any goroutine (Engine.TierStats).
type tierCounters struct {
	promptTokens, cachedTokens atomic.Int64
	byTier                     [3]atomic.Int64 // cached tokens found in GPU, CPU, DISK
	diskRead, diskWritten      atomic.Int64
	offloaded                  [2]atomic.Int64 // blocks copied to CPU, DISK
	peerFetches                [numPeerOutcomes]atomic.Int64
	peerTokens                 atomic.Int64 // prompt tokens pulled from peers
	onboardSkipped             atomic.Int64 // lower-tier hit blocks computed for want of GPU room
	loadCapped                 atomic.Int64 // lower-tier hit blocks computed as max_load_tokens asked
}

// The outcomes of a request told to fetch its prefix from a peer (TierStats.PeerFetches).
const (
	PeerPulled   = iota // pulled what the holder gave
	PeerPartial         // room for only part of the prompt when it came up: pulled its leading blocks, computed the rest
	PeerFallback        // the holder gave nothing, did not answer, or the pull failed: computed
	PeerNoRoom          // not enough free blocks for a block more than computing takes: computed
	numPeerOutcomes
)

// TierStats are an engine's KV totals since it started: prompt tokens admitted and those
// found cached, by the tier that held them, and the disk tier's traffic.
type TierStats struct {
	PromptTokens, CachedTokens int64
	// CachedByTier is indexed GPU, CPU, DISK.
	CachedByTier                [3]int64
	DiskReadBytes, DiskWritten  int64
	OffloadedCPU, OffloadedDisk int64
	// PeerFetches counts peer fetches by outcome: PeerPulled, PeerPartial, PeerFallback,
	// PeerNoRoom; PeerTokens, the prompt tokens they pulled (cached, but in no tier of this
	// engine's when the request came: not in CachedTokens).
	PeerFetches [numPeerOutcomes]int64
	PeerTokens  int64
	// OnboardSkipped counts host or disk hit blocks computed instead of brought back, for
	// want of free GPU blocks when their request came up; LoadCapped, those computed because
	// the request's max_load_tokens asked.
	OnboardSkipped, LoadCapped int64
}

// TierStats returns the engine's KV totals. It is safe to call from any goroutine.
func (e *Engine) TierStats() TierStats {
	c := &e.kvm.stats
	s := TierStats{PromptTokens: c.promptTokens.Load(), CachedTokens: c.cachedTokens.Load(),
		DiskReadBytes: c.diskRead.Load(), DiskWritten: c.diskWritten.Load(),
		OffloadedCPU: c.offloaded[0].Load(), OffloadedDisk: c.offloaded[1].Load()}
	for i := range s.CachedByTier {
		s.CachedByTier[i] = c.byTier[i].Load()
	}
	for i := range s.PeerFetches {
		s.PeerFetches[i] = c.peerFetches[i].Load()
	}
	s.PeerTokens = c.peerTokens.Load()
	s.OnboardSkipped = c.onboardSkipped.Load()
	s.LoadCapped = c.loadCapped.Load()
	return s
}

// tierMedia are the media of TierStats.CachedByTier's indices.
var tierMedia = [3]string{MediumGPU, MediumCPU, MediumDISK}

// blockMeta is what a tier needs of a block beyond its hash: its tokens, parent and keys for
// the events that announce it in another tier, and its reuse and pin.
type blockMeta struct {
	tokens    []uint32
	parent    uint64
	hasParent bool
	keys      *blockhash.Keys // nil: none
	first     int             // its index in the request that stored it
	hits      int32           // requests that found it cached, in any tier
	ephemeral bool
	// generated: the block holds only tokens its request generated (what
	// Config.LearnWriteOnce learns from).
	generated bool
	// pinUntil is when its pin lapses (Unix ns; 0: not pinned), pinTTL what a hit renews.
	pinUntil, pinTTL int64
}

// The tiers, as TierStats.CachedByTier indexes them.
const (
	tierGPU = iota
	tierHost
	tierDisk
)

func (m *blockManager) isPinned(h uint64) bool {
	b := m.meta[h]
	return b != nil && b.pinUntil > m.now
}

// countHits counts a request's cached blocks by the tier that held them (indexed as
// TierStats.CachedByTier).
func (m *blockManager) countHits(blocks [3]int) {
	for t, n := range blocks {
		if n > 0 {
			m.metrics.tierHit(tierMedia[t], n*m.cfg.BlockSize)
			m.stats.byTier[t].Add(int64(n * m.cfg.BlockSize))
		}
	}
}

// onboardTime is the modelled time of bringing blocks back to GPU memory: host blocks at
// Config.HostBandwidth, disk blocks at the real read time or Config.DiskBandwidth, whichever
// is slower, the modelled bytes (Config.KVBytesPerToken) scaled by the speedup.
func (m *blockManager) onboardTime(host, disk int, diskRead time.Duration) time.Duration {
	if host == 0 && disk == 0 {
		return 0
	}
	s := m.cfg.Timing.Speedup
	if s <= 0 {
		s = 1
	}
	blockBytes := float64(m.cfg.BlockSize) * float64(m.cfg.KVBytesPerToken)
	var d time.Duration
	if host > 0 && m.cfg.HostBandwidth > 0 {
		d += time.Duration(float64(host) * blockBytes / m.cfg.HostBandwidth / s * float64(time.Second))
	}
	if disk > 0 {
		floor := time.Duration(0)
		if m.cfg.DiskBandwidth > 0 {
			floor = time.Duration(float64(disk) * blockBytes / m.cfg.DiskBandwidth / s * float64(time.Second))
		}
		d += max(diskRead, floor)
	}
	return d
}

// hit counts a reuse of h, renews its pin, and (offloading on store) writes a block that
// reached the disk's admission count through to disk.
func (m *blockManager) hit(h uint64) {
	if !m.tiered {
		return
	}
	b := m.meta[h]
	if b == nil {
		return
	}
	if b.generated && b.hits == 0 && !b.ephemeral {
		m.writeOnce.observe(true)
	}
	b.hits++
	if b.pinUntil > m.now {
		b.pinUntil = max(b.pinUntil, m.now+b.pinTTL)
	}
	if m.host != nil {
		m.host.touch(h)
	}
	if m.disk != nil {
		m.disk.touch(h)
		if m.cfg.OffloadOn == OffloadOnStore && !b.ephemeral && !m.disk.has(h) && int(b.hits) >= m.cfg.DiskAdmitMinHits {
			m.toDisk(h, b)
		}
	}
}

// stored records that r's block b became the GPU's cached copy in block id: its metadata,
// its class, a pin when r asks for one, and a copy on host when offloading on store.
func (m *blockManager) stored(r *Request, b int, id int32) {
	if !m.tiered {
		return
	}
	h := r.hashes[b]
	bs := m.cfg.BlockSize
	meta := m.meta[h]
	if meta == nil {
		meta = &blockMeta{tokens: slices.Clone(r.tokens[b*bs : (b+1)*bs]), first: b}
		if b > 0 {
			meta.parent, meta.hasParent = r.hashes[b-1], true
		}
		if !r.keys.Empty() {
			meta.keys = &r.keys
		}
		m.meta[h] = meta
	}
	if b*bs >= r.promptLen {
		meta.generated = true
		if !meta.pinned(m.now) && (r.Params.EphemeralOutput || m.learnedWriteOnce(r)) {
			meta.ephemeral = true
			m.pool.MarkEphemeral(id)
		}
	}
	if r.Params.PinTTL > 0 && (b+1)*bs <= r.promptLen {
		m.pin(h, r.Params.PinTTL)
	}
	if m.host != nil && m.cfg.OffloadOn == OffloadOnStore && !meta.ephemeral && !m.host.has(h) {
		m.through = append(m.through, h)
	}
}

// writeThrough copies to host the blocks stored since the last call (offloading on store),
// once the caller has published their GPU store.
func (m *blockManager) writeThrough() {
	for _, h := range m.through {
		if b := m.meta[h]; b != nil && !m.host.has(h) {
			m.toHost(h, b)
		}
	}
	m.through = m.through[:0]
}

func (b *blockMeta) pinned(now int64) bool { return b.pinUntil > now }

// evicted moves the blocks the GPU tier just evicted down where they belong — a pinned block
// always to host, any other but an ephemeral one when offloading on eviction — before the
// caller publishes their removal from the GPU, forgets those no tier holds, and returns the
// hashes to publish as removed from the GPU: all of them (one cached there again since was
// announced after this removal).
func (m *blockManager) evicted(hashes []uint64) []uint64 {
	if !m.tiered {
		return hashes
	}
	out := hashes[:0]
	for _, h := range hashes {
		out = append(out, h)
		if m.onGPU(h) {
			// Cached again since (onboarded or recomputed in the same step): the evicted
			// copy is gone, the new one was announced after this removal.
			continue
		}
		b := m.meta[h]
		if b == nil {
			continue
		}
		m.metrics.evicted(b.class(m.now))
		if b.generated && b.hits == 0 && !b.ephemeral {
			m.writeOnce.observe(false) // left the GPU unread
		}
		if m.host != nil && !m.host.has(h) && !b.ephemeral && (m.cfg.OffloadOn == OffloadOnEvict || b.pinned(m.now)) {
			m.toHost(h, b)
		}
		m.forget(h, b)
	}
	return out
}

func (b *blockMeta) class(now int64) string {
	switch {
	case b.ephemeral:
		return "ephemeral"
	case b.pinned(now):
		return "pinned"
	case b.hits > 0:
		return "reused"
	}
	return "once"
}

// forget drops h's metadata when no tier holds it.
func (m *blockManager) forget(h uint64, b *blockMeta) {
	if m.onGPU(h) {
		return
	}
	if (m.host != nil && m.host.has(h)) || (m.disk != nil && m.disk.has(h)) {
		return
	}
	if b.pinned(m.now) {
		m.pinned--
	}
	delete(m.meta, h)
}

// toHost copies h to host memory, making room by evicting host's least recently used
// unpinned block (to disk if it earned it).
func (m *blockManager) toHost(h uint64, b *blockMeta) {
	for m.host.len() >= m.host.capacity {
		v, ok := m.host.victim(m.isPinned)
		if !ok {
			return
		}
		vb := m.meta[v]
		if m.disk != nil && vb != nil && !m.disk.has(v) && (int(vb.hits) >= m.cfg.DiskAdmitMinHits || vb.pinned(m.now)) {
			m.toDisk(v, vb)
		}
		m.host.drop(v)
		m.removedEvent(v, MediumCPU)
		if vb != nil {
			m.forget(v, vb)
		}
	}
	m.host.add(h)
	m.metaEvent(h, b, MediumCPU)
	m.metrics.offloaded(MediumCPU)
	m.stats.offloaded[0].Add(1)
}

// toDisk writes h to the disk tier, evicting its least recently used unpinned block when
// full. A write that fails (a full disk) leaves h off disk, counted.
func (m *blockManager) toDisk(h uint64, b *blockMeta) {
	for m.disk.len() >= m.disk.capacity {
		v, ok := m.disk.victim(m.isPinned)
		if !ok {
			return
		}
		m.disk.drop(v)
		m.removedEvent(v, m.disk.medium)
		if vb := m.meta[v]; vb != nil {
			m.forget(v, vb)
		}
	}
	n, err := m.disk.write(h)
	if err != nil {
		m.metrics.diskError("write")
		return
	}
	m.metrics.diskWritten(n)
	m.stats.diskWritten.Add(int64(n))
	m.stats.offloaded[1].Add(1)
	m.disk.add(h)
	m.metaEvent(h, b, m.disk.medium)
	m.metrics.offloaded(MediumDISK)
}

// readable reports whether the host or disk tier holds h so that it can be given to a peer:
// a disk block is read back (its real read time and bytes counted) and checked first.
func (m *blockManager) readable(h uint64) bool {
	if m.host != nil && m.host.has(h) {
		m.host.touch(h)
		return true
	}
	if m.disk == nil || !m.disk.has(h) {
		return false
	}
	n, err := m.disk.read(h)
	m.metrics.diskRead(n)
	m.stats.diskRead.Add(int64(n))
	if err != nil {
		m.diskFailed(h, err) // a miss, announced
		return false
	}
	m.disk.touch(h)
	return true
}

// diskFailed handles a disk block that could not be read back: a miss, counted, its file
// removed and its removal published.
func (m *blockManager) diskFailed(h uint64, err error) {
	reason := "read"
	if errors.Is(err, errCorrupt) {
		reason = "checksum"
	}
	m.metrics.diskError(reason)
	m.disk.drop(h)
	m.removedEvent(h, m.disk.medium)
	if b := m.meta[h]; b != nil {
		m.forget(h, b)
	}
}

// pin pins h for ttl, or renews its pin; a new pin beyond Config.MaxPinnedFraction of the GPU
// tier is refused (counted), so that pins cannot starve running requests.
func (m *blockManager) pin(h uint64, ttl time.Duration) {
	b := m.meta[h]
	if b == nil || b.ephemeral {
		return
	}
	until := m.now + int64(ttl)
	if b.pinned(m.now) {
		b.pinUntil, b.pinTTL = max(b.pinUntil, until), max(b.pinTTL, int64(ttl))
		return
	}
	if m.pinned >= m.maxPins {
		m.metrics.pinRefused()
		return
	}
	b.pinUntil, b.pinTTL = until, int64(ttl)
	m.pinned++
	m.pinList = append(m.pinList, h)
	if m.nextPin == 0 || until < m.nextPin {
		m.nextPin = until
	}
	m.pool.Repin(h)
	m.metrics.pins(m.pinned)
}

// expirePins lets lapsed pins go: their GPU blocks rejoin their class's free queue.
func (m *blockManager) expirePins() {
	live := m.pinList[:0]
	m.nextPin = 0
	lapsed := false
	for _, h := range m.pinList {
		b := m.meta[h]
		if b == nil || b.pinUntil == 0 {
			continue
		}
		if b.pinUntil <= m.now {
			b.pinUntil = 0
			m.pinned--
			lapsed = true
			continue
		}
		live = append(live, h)
		if m.nextPin == 0 || b.pinUntil < m.nextPin {
			m.nextPin = b.pinUntil
		}
	}
	clear(m.pinList[len(live):])
	m.pinList = live
	if lapsed {
		m.pool.Requeue()
	}
	m.metrics.pins(m.pinned)
}

// Learning write-once output (Config.LearnWriteOnce).
const (
	// writeOnceShare is the share of generated blocks resent below which the engine takes
	// generated blocks to be write-once; writeOnceMin the decayed observations it needs
	// first; writeOnceProbe leaves one request in that many unmarked, to keep learning.
	writeOnceShare = 0.1
	writeOnceMin   = 64
	writeOnceProbe = 16
	// writeOnceDecay weighs older observations down, so a change of workload shows.
	writeOnceDecay = 0.998
)

// writeOnceEstimate is the decayed count of generated blocks a later request resent, and of
// those that left the GPU unread.
type writeOnceEstimate struct{ resent, unread float64 }

func (w *writeOnceEstimate) observe(resent bool) {
	w.resent *= writeOnceDecay
	w.unread *= writeOnceDecay
	if resent {
		w.resent++
	} else {
		w.unread++
	}
}

// share is the estimated share of generated blocks resent, and whether it rests on enough
// observations.
func (w *writeOnceEstimate) share() (float64, bool) {
	n := w.resent + w.unread
	if n < writeOnceMin {
		return 0, false
	}
	return w.resent / n, true
}

// learnedWriteOnce reports whether r's generated blocks are taken for write-once: the engine
// learns it and its estimate says generated blocks are hardly ever resent, and r is not a
// probe.
func (m *blockManager) learnedWriteOnce(r *Request) bool {
	if !m.cfg.LearnWriteOnce || m.cfg.Eviction != EvictWORM || r.seqNo%writeOnceProbe == 0 {
		return false
	}
	s, ok := m.writeOnce.share()
	return ok && s < writeOnceShare
}
