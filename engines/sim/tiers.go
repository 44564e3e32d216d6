package sim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/zeebo/xxh3"
)

// The media of KV events, as vLLM's offloading connector and SGLang's HiCache name them.
const (
	MediumGPU  = "GPU"
	MediumCPU  = "CPU"
	MediumDISK = "DISK"
	// MediumShared is the disk tier when its directory is storage several workers mount
	// (Config.DiskShared): published as vLLM's STORAGE with locality REMOTE.
	MediumShared = "SHARED"
)

// lowerTier is a tier below the GPU's: host memory (G2) or disk (G3). It holds blocks by
// sequence hash (blocks are immutable, so a copy is as good as the original), up to its
// capacity, and evicts the least recently used one that is not pinned (a pinned one only
// when every block is). The disk tier keeps each block's bytes in a file of its own in dir:
// the block's deterministic payload (fillSlot, as the P/D path moves it) and an xxh3 checksum
// of it, so that disk I/O, a full disk and a corrupt file are real.
//
// A lowerTier is owned by its engine's scheduler goroutine.
type lowerTier struct {
	medium     string
	capacity   int
	entries    map[uint64]*tierEntry
	head, tail *tierEntry // head is evicted first

	// Disk only.
	dir       string
	fsync     bool
	slotBytes int
	buf       []byte
	// shared: dir is storage other workers write to as well: a block is held when its file
	// is there, whoever wrote it; the tier evicts only the files it wrote (entries).
	shared bool
}

type tierEntry struct {
	hash       uint64
	prev, next *tierEntry
}

func newLowerTier(medium string, capacity int) *lowerTier {
	return &lowerTier{medium: medium, capacity: capacity, entries: make(map[uint64]*tierEntry, capacity)}
}

// newDiskTier opens dir for the disk tier, creating it; block files left there by an earlier
// run are removed, since nothing indexes them (the engine's events start from empty), unless
// the directory is shared: other workers' blocks are theirs to remove.
func newDiskTier(dir string, capacity, slotBytes int, fsync, shared bool) (*lowerTier, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("disk offload dir: %w", err)
	}
	if !shared {
		old, err := filepath.Glob(filepath.Join(dir, "*.kvblock"))
		if err != nil {
			return nil, fmt.Errorf("disk offload dir: %w", err)
		}
		for _, f := range old {
			if err := os.Remove(f); err != nil {
				return nil, fmt.Errorf("disk offload dir: %w", err)
			}
		}
	}
	medium := MediumDISK
	if shared {
		medium = MediumShared
	}
	t := newLowerTier(medium, capacity)
	t.dir, t.fsync, t.slotBytes, t.shared = dir, fsync, slotBytes, shared
	t.buf = make([]byte, slotBytes+8)
	return t, nil
}

func (t *lowerTier) len() int { return len(t.entries) }

func (t *lowerTier) has(h uint64) bool {
	if _, ok := t.entries[h]; ok {
		return true
	}
	if t.shared {
		_, err := os.Stat(t.path(h))
		return err == nil
	}
	return false
}

func (t *lowerTier) unlink(e *tierEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		t.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		t.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

func (t *lowerTier) pushTail(e *tierEntry) {
	e.prev, e.next = t.tail, nil
	if t.tail != nil {
		t.tail.next = e
	} else {
		t.head = e
	}
	t.tail = e
}

// touch makes h the most recently used block.
func (t *lowerTier) touch(h uint64) {
	if e := t.entries[h]; e != nil && e != t.tail {
		t.unlink(e)
		t.pushTail(e)
	}
}

// victim is the block an insertion into a full tier evicts: the least recently used one not
// pinned, or the least recently used one when all are.
func (t *lowerTier) victim(pinned func(uint64) bool) (uint64, bool) {
	for e := t.head; e != nil; e = e.next {
		if pinned == nil || !pinned(e.hash) {
			return e.hash, true
		}
	}
	if t.head != nil {
		return t.head.hash, true
	}
	return 0, false
}

// add records h as held by the tier (the caller made room and, on disk, wrote it).
func (t *lowerTier) add(h uint64) {
	e := &tierEntry{hash: h}
	t.entries[h] = e
	t.pushTail(e)
}

// drop forgets h and, on disk, removes its file (in a shared directory, a file another
// worker wrote too: drop is for blocks that are gone or bad).
func (t *lowerTier) drop(h uint64) {
	e := t.entries[h]
	if e == nil {
		if t.shared {
			_ = os.Remove(t.path(h))
		}
		return
	}
	t.unlink(e)
	delete(t.entries, h)
	if t.dir != "" {
		_ = os.Remove(t.path(h))
	}
}

// clear forgets every block (and removes the disk tier's files: in a shared directory, the
// ones this worker wrote).
func (t *lowerTier) clear() {
	for h := range t.entries {
		t.drop(h)
	}
}

func (t *lowerTier) path(h uint64) string {
	return filepath.Join(t.dir, strconv.FormatUint(h, 16)+".kvblock")
}

// errCorrupt is a block file whose bytes are not the block's.
var errCorrupt = errors.New("block file does not hold the block's KV (checksum mismatch)")

// write stores h's payload in its file: the payload, then its xxh3 checksum, fsynced when the
// tier says so. It returns the bytes written.
func (t *lowerTier) write(h uint64) (int, error) {
	b := t.buf[:t.slotBytes]
	fillSlot(b, h)
	t.buf = binary.LittleEndian.AppendUint64(t.buf[:t.slotBytes], xxh3.Hash(b))
	f, err := os.OpenFile(t.path(h), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return 0, err
	}
	n, err := f.Write(t.buf)
	if err == nil && t.fsync {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(t.path(h))
		return n, err
	}
	return n, nil
}

// read reads h's file back and checks it: its checksum and that the payload is h's. It
// returns the bytes read; errCorrupt when they are not the block's.
func (t *lowerTier) read(h uint64) (int, error) {
	f, err := os.Open(t.path(h))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := t.buf[:t.slotBytes+8]
	n, err := f.ReadAt(buf, 0)
	if err != nil {
		return n, fmt.Errorf("%w: %v", errCorrupt, err)
	}
	payload := buf[:t.slotBytes]
	if binary.LittleEndian.Uint64(buf[t.slotBytes:]) != xxh3.Hash(payload) || !checkSlot(payload, h) {
		return n, errCorrupt
	}
	if st, err := f.Stat(); err == nil && st.Size() != int64(len(buf)) {
		return n, errCorrupt
	}
	return n, nil
}
