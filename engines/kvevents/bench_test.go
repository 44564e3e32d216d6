package kvevents

import "testing"

// The typical batch is one engine step: four BlockStored events of two 16-token blocks each
// and one BlockRemoved of three blocks (typicalBatch).

func BenchmarkAppendBatch(b *testing.B) {
	batch := typicalBatch()
	for _, f := range []Format{FormatMap, FormatArray} {
		b.Run(f.String(), func(b *testing.B) {
			buf := AppendBatch(nil, batch, f)
			b.SetBytes(int64(len(buf)))
			b.ReportAllocs()
			for b.Loop() {
				buf = AppendBatch(buf[:0], batch, f)
			}
		})
	}
}

func BenchmarkDecodeBatch(b *testing.B) {
	batch := typicalBatch()
	for _, f := range []Format{FormatMap, FormatArray} {
		data := AppendBatch(nil, batch, f)
		b.Run(f.String(), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := DecodeBatch(data); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(f.String()+"/into", func(b *testing.B) {
			var dst Batch
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				if err := DecodeBatchInto(&dst, data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkPublish(b *testing.B) {
	batch := typicalBatch()
	p, err := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0", QueueSize: 1 << 20})
	if err != nil {
		b.Fatal(err)
	}
	if err := p.Start(b.Context()); err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	b.ReportAllocs()
	for b.Loop() {
		_ = p.Publish(batch)
	}
}
