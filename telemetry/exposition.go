package telemetry

import (
	"bytes"
	"cmp"
	"compress/flate"
	"context"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// Exposition is a Collector's series rendered once for each change of what
// it reads, off the scrape path, into the text format, deflated. The
// figures change once per sampler or tracker pass (10 s), and a node with
// 100 holders has over 4,000 series (17,000 at 8 GPUs × 48 replicas, each
// its own holder): gathering them through a registry (a hash of every
// series' labels, a sort of each family) and encoding them at every scrape
// cost 26 ms of CPU, rendering them once per pass leaves a gzip scrape
// (what Prometheus asks for) the copy of bytes (BenchmarkHolderScrape).
//
// A rendering keeps only the deflated bytes: 131 kB for the 17,000 series,
// whose plain text is 6.9 MB and whose metric families took 14 MB more
// (BenchmarkHolderMemory). A scrape that takes no gzip gets them inflated;
// delimited protobuf is rendered beside the text from the first scrape
// that asks for it on; what else a scraper may ask for (a name[] filter,
// protobuf as text) is gathered afresh, at the cost of a rendering.
//
// A scrape never serves a rendering older than its inputs: it compares the
// sources' snapshots (each immutable once published) with those the
// rendering was made from, and renders anew when one differs. Render,
// after each pass (through Kick and Run), keeps that rare; the one input
// not compared is the DRA source's answer for a claim, which a pass's
// rendering picks up.
type Exposition struct {
	col  *Collector
	kick chan struct{}

	// mu serialises renders, so that a scrape that finds the rendering
	// stale while Run renders waits for that rendering.
	mu  sync.Mutex
	cur atomic.Pointer[rendering]
	// wantProto: a scraper asked for protobuf, so renders encode it too.
	wantProto atomic.Bool
}

// rendering is one rendering of a Collector; immutable once published.
type rendering struct {
	in    collectInputs
	names map[string]bool
	// text is the families in the text format. Its bytes, like proto's,
	// are the same for every version and escaping scheme of the format,
	// as every name is a legacy one (TestExpositionNamesLegacy).
	text encoded
	// proto is them as delimited protobuf, encoded at the first scrape
	// that asks for it (from the families gathered again from in), or at
	// the render after one did.
	protoOnce sync.Once
	proto     encoded
	protoErr  error
}

// encoded is the families in one format, deflated.
type encoded struct {
	// deflated is the plain bytes as raw deflate blocks, none final,
	// ending on a byte boundary (a sync flush): a gzip body can go on
	// from there.
	deflated []byte
	crc      uint32 // CRC-32 (IEEE) of the plain bytes
	size     int    // how many plain bytes
}

// inflatePool keeps deflate readers for scrapes that take no gzip (each
// holds a 32 kB window and its tables).
var inflatePool = sync.Pool{New: func() any { return flate.NewReader(bytes.NewReader(nil)) }}

// writePlain writes the plain bytes of enc to w.
func writePlain(w io.Writer, enc *encoded) error {
	fr := inflatePool.Get().(io.ReadCloser)
	defer inflatePool.Put(fr)
	if err := fr.(flate.Resetter).Reset(bytes.NewReader(enc.deflated), nil); err != nil {
		return err
	}
	// Exactly size bytes: the blocks end with no final one, which a
	// reader asked for more would take as a truncated stream.
	_, err := io.CopyN(w, fr, int64(enc.size))
	return err
}

// encode encodes mfs in format, deflated as it goes (BestSpeed: on the
// 1.8 MB of 100 holders' text, 4 ms for 53 kB, where the default level
// takes 50 ms for 40 kB).
func encode(mfs []*dto.MetricFamily, format expfmt.Format) (encoded, error) {
	var z bytes.Buffer
	fw, err := flate.NewWriter(&z, flate.BestSpeed)
	if err != nil {
		return encoded{}, err
	}
	plain := &crcWriter{w: fw}
	enc := expfmt.NewEncoder(plain, format)
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return encoded{}, fmt.Errorf("encode %s: %w", mf.GetName(), err)
		}
	}
	if err := fw.Flush(); err != nil {
		return encoded{}, fmt.Errorf("deflate: %w", err)
	}
	return encoded{deflated: bytes.Clone(z.Bytes()), crc: plain.crc, size: plain.n}, nil
}

// NewExposition returns the rendering of col, rendered at the first
// scrape or Render.
func NewExposition(col *Collector) *Exposition {
	return &Exposition{col: col, kick: make(chan struct{}, 1)}
}

// Kick asks Run to render soon: call it when a source published a new
// snapshot. It never blocks.
func (e *Exposition) Kick() {
	select {
	case e.kick <- struct{}{}:
	default:
	}
}

// Run renders after each Kick until ctx is done.
func (e *Exposition) Run(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-e.kick:
			// An error comes back at the next scrape, which renders again.
			_ = e.Render()
		}
	}
}

// Render renders the sources' current snapshots now.
func (e *Exposition) Render() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	_, err := e.renderLocked(e.col.inputs())
	return err
}

// current returns a rendering of the sources' current snapshots, the last
// one if they have not changed since.
func (e *Exposition) current() (*rendering, error) {
	in := e.col.inputs()
	if r := e.cur.Load(); r != nil && r.in == in {
		return r, nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if r := e.cur.Load(); r != nil && r.in == in {
		return r, nil // rendered while this scrape waited
	}
	return e.renderLocked(in)
}

// gather gathers the series of in through a registry of its own, which
// checks them as a scrape's registry would (label values, duplicates) and
// sorts them.
func (e *Exposition) gather(in collectInputs) ([]*dto.MetricFamily, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(pinnedCollector{e.col, in}); err != nil {
		return nil, fmt.Errorf("render GPU metrics: %w", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		return nil, fmt.Errorf("render GPU metrics: %w", err)
	}
	return mfs, nil
}

// renderLocked renders in; the families are dropped once encoded.
func (e *Exposition) renderLocked(in collectInputs) (*rendering, error) {
	mfs, err := e.gather(in)
	if err != nil {
		return nil, err
	}
	r := &rendering{in: in, names: make(map[string]bool, len(mfs))}
	for _, mf := range mfs {
		r.names[mf.GetName()] = true
	}
	if r.text, err = encode(mfs, expfmt.NewFormat(expfmt.TypeTextPlain)); err != nil {
		return nil, fmt.Errorf("render GPU metrics: %w", err)
	}
	if e.wantProto.Load() {
		r.protoOnce.Do(func() { r.proto, r.protoErr = encode(mfs, expfmt.NewFormat(expfmt.TypeProtoDelim)) })
		if r.protoErr != nil {
			return nil, fmt.Errorf("render GPU metrics: %w", r.protoErr)
		}
	}
	e.cur.Store(r)
	return r, nil
}

// protobuf returns r's families as delimited protobuf, gathering them
// again if r was rendered before any scraper asked for protobuf.
func (e *Exposition) protobuf(r *rendering) (*encoded, error) {
	r.protoOnce.Do(func() {
		mfs, err := e.gather(r.in)
		if err == nil {
			r.proto, err = encode(mfs, expfmt.NewFormat(expfmt.TypeProtoDelim))
		}
		r.protoErr = err
	})
	return &r.proto, r.protoErr
}

// Gather implements [prometheus.Gatherer]: the families of the sources'
// current snapshots, gathered now (a rendering keeps none).
func (e *Exposition) Gather() ([]*dto.MetricFamily, error) {
	return e.gather(e.col.inputs())
}

// pinnedCollector collects the series of fixed inputs.
type pinnedCollector struct {
	c  *Collector
	in collectInputs
}

func (p pinnedCollector) Describe(ch chan<- *prometheus.Desc) { p.c.Describe(ch) }
func (p pinnedCollector) Collect(ch chan<- prometheus.Metric) { p.c.collect(ch, p.in) }

// gatherers is the families of both, merged by name; a name in both is an
// error, as it would be in one registry.
type gatherers struct {
	reg prometheus.Gatherer
	exp *Exposition
}

func (g gatherers) Gather() ([]*dto.MetricFamily, error) {
	a, err := g.reg.Gather()
	if err != nil {
		return nil, err
	}
	b, err := g.exp.Gather()
	if err != nil {
		return nil, err
	}
	out := make([]*dto.MetricFamily, 0, len(a)+len(b))
	for len(a) > 0 && len(b) > 0 {
		switch cmp.Compare(a[0].GetName(), b[0].GetName()) {
		case -1:
			out, a = append(out, a[0]), a[1:]
		case 1:
			out, b = append(out, b[0]), b[1:]
		default:
			return nil, duplicateFamily(a[0].GetName())
		}
	}
	return append(append(out, a...), b...), nil
}

func duplicateFamily(name string) error {
	return fmt.Errorf("metric family %s both in the registry and in the GPU metrics", name)
}

// MetricsHandler serves /metrics: the families reg gathers at each scrape,
// and e's rendering. The text format (what Prometheus asks for by default)
// and delimited protobuf (what it asks for first with native histograms)
// are served from the rendering's deflated bytes (copied into a gzip
// body, inflated for a scraper that takes no gzip), e's families first;
// every other request (protobuf as text, a name[] filter) goes through
// promhttp with both merged, e's families gathered afresh. promhttp's
// error counter is registered on reg.
func MetricsHandler(reg *prometheus.Registry, e *Exposition) http.Handler {
	all := promhttp.HandlerFor(gatherers{reg, e}, promhttp.HandlerOpts{Registry: reg})
	accepted := expfmt.DefaultAcceptedFormats()
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		format := expfmt.NegotiateAccept(req.Header, accepted...)
		typ := format.FormatType()
		if (typ != expfmt.TypeTextPlain && typ != expfmt.TypeProtoDelim) || (req.URL != nil && req.URL.Query().Has("name[]")) {
			all.ServeHTTP(w, req)
			return
		}
		r, err := e.current()
		var enc *encoded
		if err == nil {
			enc = &r.text
			if typ == expfmt.TypeProtoDelim {
				e.wantProto.Store(true)
				enc, err = e.protobuf(r)
			}
		}
		var mfs []*dto.MetricFamily
		if err == nil {
			mfs, err = reg.Gather()
		}
		if err == nil {
			for _, mf := range mfs {
				if r.names[mf.GetName()] {
					err = duplicateFamily(mf.GetName())
					break
				}
			}
		}
		if err != nil {
			http.Error(w, "An error has occurred while serving metrics:\n\n"+err.Error(), http.StatusInternalServerError)
			return
		}
		h := w.Header()
		h.Add("Vary", "Accept")
		h.Add("Vary", "Accept-Encoding")
		h.Set("Content-Type", string(format))
		if !acceptsGzip(req.Header.Get("Accept-Encoding")) {
			if err := writePlain(w, enc); err != nil {
				return // the client went away
			}
			live := expfmt.NewEncoder(w, format)
			for _, mf := range mfs {
				if live.Encode(mf) != nil {
					return
				}
			}
			return
		}
		h.Set("Content-Encoding", "gzip")
		_ = writeGzip(w, enc, mfs, format)
	})
}

// gzipHeader is a gzip member's header: deflate, no name, no time, OS
// unknown (RFC 1952, 2.3).
var gzipHeader = []byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff}

// flatePool keeps deflate writers for the live part of gzip bodies (each
// holds about a megabyte of tables).
var flatePool = sync.Pool{New: func() any {
	fw, _ := flate.NewWriter(nil, flate.BestSpeed)
	return fw
}}

// writeGzip writes one gzip member: the rendering's deflated bytes, then
// mfs deflated now, then the trailer over both. Deflate blocks that end
// on a byte boundary can be followed by any others (RFC 1951: a block
// refers back only to data before it, which here a fresh compressor never
// does), so the rendering's blocks need no compressing per scrape.
func writeGzip(w io.Writer, r *encoded, mfs []*dto.MetricFamily, format expfmt.Format) error {
	if _, err := w.Write(gzipHeader); err != nil {
		return err
	}
	if _, err := w.Write(r.deflated); err != nil {
		return err
	}
	fw := flatePool.Get().(*flate.Writer)
	defer flatePool.Put(fw)
	fw.Reset(w)
	live := &crcWriter{w: fw, crc: r.crc}
	enc := expfmt.NewEncoder(live, format)
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return err
		}
	}
	if err := fw.Close(); err != nil {
		return err
	}
	var trailer [8]byte
	binary.LittleEndian.PutUint32(trailer[:4], live.crc)
	binary.LittleEndian.PutUint32(trailer[4:], uint32(r.size+live.n))
	_, err := w.Write(trailer[:])
	return err
}

// crcWriter writes through to w, carrying on the CRC-32 and length of what
// came before.
type crcWriter struct {
	w   io.Writer
	crc uint32
	n   int
}

func (c *crcWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.crc = crc32.Update(c.crc, crc32.IEEETable, p[:n])
	c.n += n
	return n, err
}

// acceptsGzip says whether an Accept-Encoding header takes gzip (RFC 9110,
// 12.5.3): listed, or under "*", with a q above 0.
func acceptsGzip(header string) bool {
	star := false
	for part := range strings.SplitSeq(header, ",") {
		coding, params, _ := strings.Cut(part, ";")
		coding = strings.ToLower(strings.TrimSpace(coding))
		if coding != "gzip" && coding != "*" {
			continue
		}
		ok := true
		for p := range strings.SplitSeq(params, ";") {
			k, v, _ := strings.Cut(strings.TrimSpace(p), "=")
			if strings.EqualFold(k, "q") {
				q, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
				ok = err == nil && q > 0
			}
		}
		if coding == "gzip" {
			return ok
		}
		star = ok
	}
	return star
}
