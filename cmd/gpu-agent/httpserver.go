package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// maxHTTPConns caps the HTTP side's connections, and with them its file
// descriptors. The agent often runs under a low RLIMIT_NOFILE and needs
// descriptors of its own for the device plugin sockets, the kubelet
// connections, NVML and inotify; a flood of HTTP clients must not be able to
// take those away and block re-registration with the kubelet. The legitimate
// clients (kubelet probes, a Prometheus scraper or two, `gpu-agent status`)
// need a handful of connections, so 64 leaves ample headroom.
const maxHTTPConns = 64

// probeReserve is how many of maxHTTPConns serve only the kubelet's probes
// (see connLimitListener). Its two probes take one connection each, for a
// second at most; the rest is room for requests beyond the limit that have
// to be read before they are refused.
const probeReserve = 8

// httpServerConfig bounds every phase of an HTTP exchange and how many
// exchanges may be open at once. Tests shrink the timeouts to milliseconds.
type httpServerConfig struct {
	ReadHeaderTimeout time.Duration // accept (or first byte of a keep-alive request) to end of headers
	ReadTimeout       time.Duration // start of a request to end of its body
	WriteTimeout      time.Duration // end of request headers to end of response
	IdleTimeout       time.Duration // keep-alive wait for the next request
	MaxHeaderBytes    int
	MaxBodyBytes      int64
	MaxConns          int      // connections open at once, ProbeReserve included
	ProbeReserve      int      // of MaxConns, those that serve only ProbePaths
	ProbePaths        []string // the paths a connection of the reserve serves
}

func defaultHTTPServerConfig() httpServerConfig {
	return httpServerConfig{
		// Probes and scrapers send their headers in one packet; this is slack
		// for a congested node, not for a slow client.
		ReadHeaderTimeout: 5 * time.Second,
		// Only /sim/ takes a body, and a small one.
		ReadTimeout: 10 * time.Second,
		// A /metrics scrape of a many-GPU node with per-pod series is the
		// largest response, and the scraper may sit across a busy network.
		WriteTimeout: 30 * time.Second,
		// Beyond the common 1m scrape interval, so a scraper keeps reusing
		// its connection; connections abandoned by clients still go away.
		IdleTimeout: 90 * time.Second,
		// Requests here carry a few short headers; an auth token is the
		// largest thing a scraper might add.
		MaxHeaderBytes: 16 << 10,
		// Far above any endpoint's needs (/sim/ bounds its own bodies at
		// 64 KiB); this bounds handlers that do not bound theirs.
		MaxBodyBytes: 1 << 20,
		MaxConns:     maxHTTPConns,
		ProbeReserve: probeReserve,
		// What the chart's livenessProbe and readinessProbe ask.
		ProbePaths: []string{"/healthz", "/readyz"},
	}
}

// newHTTPServer listens on addr and returns a server for h whose
// connections the returned listener caps; pass that listener to Serve.
// The server's ConnState and ConnContext hooks belong to the listener.
func newHTTPServer(addr string, h http.Handler, cfg httpServerConfig, log *slog.Logger) (*http.Server, *connLimitListener, error) {
	if cfg.ProbeReserve < 0 || cfg.MaxConns-cfg.ProbeReserve < 1 {
		return nil, nil, fmt.Errorf("HTTP connection limit %d with %d of them kept for probes: want at least 1 for everyone", cfg.MaxConns, cfg.ProbeReserve)
	}
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		return deferAccept(rc, cfg.ReadHeaderTimeout)
	}}
	inner, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	ln := newConnLimitListener(inner, cfg.MaxConns, cfg.ProbeReserve, cfg.ProbePaths, log)
	srv := &http.Server{
		Handler:           ln.guard(h, cfg.MaxBodyBytes),
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		ReadTimeout:       cfg.ReadTimeout,
		WriteTimeout:      cfg.WriteTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		ConnState:         ln.connState,
		ConnContext:       ln.connContext,
	}
	return srv, ln, nil
}

// connPhase is where a connection stands, as far as deciding whether it
// may be closed to admit another.
type connPhase uint8

const (
	// phaseNew: accepted, its first request's headers not yet read.
	phaseNew connPhase = iota
	// phaseIdle: between requests, including while the next one's headers
	// arrive.
	phaseIdle
	// phaseBody: the request's body is still owed by the client.
	phaseBody
	// phaseBusy: the agent is working on a request or writing its response.
	phaseBusy
)

// connLimitListener keeps at most max connections open, and has the
// kubelet's probes answered however many other clients crowd it.
//
// Admitting a connection must not wait for a timeout to expire somewhere,
// or a crowd of idle or slow clients would starve the probes. So when every
// slot is taken, the listener closes a connection that waits on its
// client: an idle keep-alive (its client reconnects transparently) first,
// then one still sending its request, longest waiting first. A connection
// waits on its client only while the server is blocked reading it and the
// kernel holds nothing unread from it; and the kernel hands a connection
// over only once its client's first bytes are in (deferAccept), so no
// client is taken for a silent one for writing a moment after the server
// read. A connection whose request has arrived, even one no goroutine has
// looked at yet, is never closed, nor one the agent is working on. Issue 23
// was the opposite: in a storm of fast scrapers each arrival closed the one
// before it, request and all, probes included.
//
// A crowd of scrapers can still fill every slot with requests that have
// arrived. For that, reserve of the max slots serve only probes. Which
// request is a probe is known only once it is read, so a connection that
// finds the other slots taken goes to the reserve and its request decides:
// a probe (a path of probes) is served, anything else is answered 503 with
// Retry-After, and the connection closes after that one request. Most such
// requests are whole in the socket when accepted, and refuseEarly answers
// them in the accept loop itself; the others go through guard. Either way a
// scraper beyond the limit gets a clean refusal rather than a reset, and a
// probe waits only behind requests being refused, never behind scrapes.
// (How soon its goroutine then runs depends on how many others are
// runnable: see fewAtATime.)
//
// A reserve on the one port rather than a port of its own for probes keeps
// the chart, the Service, NetworkPolicies and anyone's checks of /healthz
// on the metrics port as they are, and every descriptor under the one cap.
// A probe port would also spare probes the wait in the kernel's accept
// queue behind a flood of connections; with refusals made in the accept
// loop that wait is short (see test/bench/cmd/scrape-storm).
//
// If every slot holds a request that has arrived, reserve included, Accept
// waits, and new clients wait in the kernel's backlog, where they hold no
// descriptor of ours.
type connLimitListener struct {
	net.Listener
	max     int      // connections open at once, the reserve included
	reserve int      // of max, the connections that serve only probes
	probes  []string // the paths a connection of the reserve serves
	log     *slog.Logger

	// One Accept at a time: take leaves room for one connection. The
	// accept loop's buffer for refuseEarly goes with it.
	accept  sync.Mutex
	peekBuf []byte
	refusal []byte // refuseEarly's answer

	mu       sync.Mutex
	cond     sync.Cond // signalled when a slot may have come free
	conns    map[*limitedConn]struct{}
	shared   int // connections outside the reserve
	reserved int // connections in the reserve
	waiting  int // Accept calls waiting for a slot
	closing  int // connections chosen to be closed, not closed yet
	peak     int
	closed   bool

	// One warning when the limit is reached and one note when the crowd
	// has gone, rather than a line per connection.
	saturated bool
	evicted   int
	refused   int
	waits     int
}

func newConnLimitListener(inner net.Listener, limit, reserve int, probes []string, log *slog.Logger) *connLimitListener {
	l := &connLimitListener{
		Listener: inner, max: limit, reserve: reserve, probes: probes, log: log,
		// A scraper's request with an auth token fits; a larger one goes
		// to the guard.
		peekBuf: make([]byte, 4<<10),
		refusal: fmt.Appendf(nil, "HTTP/1.1 503 Service Unavailable\r\n"+
			"Content-Type: text/plain; charset=utf-8\r\nRetry-After: %s\r\nConnection: close\r\n"+
			"Content-Length: %d\r\n\r\n%s", retryAfter, len(refusalBody), refusalBody),
		conns: make(map[*limitedConn]struct{}),
	}
	l.cond.L = &l.mu
	return l
}

// Open is how many accepted connections are not yet closed.
func (l *connLimitListener) Open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// Peak is the most connections that were ever open at once.
func (l *connLimitListener) Peak() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.peak
}

// Accept implements [net.Listener.Accept]: it waits for a slot before it
// accepts, so that no more than max descriptors are ever open.
func (l *connLimitListener) Accept() (net.Conn, error) {
	l.accept.Lock()
	defer l.accept.Unlock()
	for {
		if err := l.take(); err != nil {
			return nil, err
		}
		nc, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		l.mu.Lock()
		reserved, full := l.placeLocked()
		warn := l.noteSaturatedLocked(full)
		closed := l.closed
		l.mu.Unlock()
		l.logSaturated(warn)
		if closed {
			_ = nc.Close()
			return nil, net.ErrClosed
		}
		if reserved && l.refuseEarly(nc) {
			continue
		}
		// Only Accept takes slots, so the one placeLocked chose is still free.
		c := &limitedConn{Conn: nc, l: l, reserved: reserved, phase: phaseNew, since: time.Now()}
		l.mu.Lock()
		l.conns[c] = struct{}{}
		if reserved {
			l.reserved++
		} else {
			l.shared++
		}
		l.peak = max(l.peak, len(l.conns))
		l.mu.Unlock()
		return c, nil
	}
}

// take waits until a connection may be accepted: a slot is free, or one
// is freed by closing a connection that waits on its client.
func (l *connLimitListener) take() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	waited := false
	for {
		if l.closed {
			return net.ErrClosed
		}
		if l.shared < l.max-l.reserve || l.reserved < l.reserve {
			return nil
		}
		if l.closing == 0 {
			l.evictLocked(func(*limitedConn) bool { return true })
		}
		if !waited {
			waited = true
			l.waits++
		}
		l.waiting++
		l.cond.Wait()
		l.waiting--
	}
}

// placeLocked says whether the connection just accepted goes to the
// reserve, and whether it found the other slots all taken. It goes to the
// reserve only if they are taken by connections that may not be closed: a
// client that merely sits on an idle keep-alive should not cost a new
// request a refusal. take left a slot free for it, and slots only come
// free while it waits here, so one of the two kinds has room.
func (l *connLimitListener) placeLocked() (reserved, full bool) {
	for {
		if l.closed || l.shared < l.max-l.reserve {
			return false, full
		}
		full = true
		if l.closing == 0 && !l.evictLocked(func(c *limitedConn) bool { return !c.reserved }) {
			return true, full
		}
		l.waiting++
		l.cond.Wait()
		l.waiting--
	}
}

// evictLocked chooses, among the connections pick allows, the one that has
// waited longest on its client, and has its goroutine close it; it says
// whether it found one. The connection is closed by the goroutine reading
// it, woken by a read deadline in the past, rather than here: if the
// client's request arrives before that read returns, the read returns it
// and the connection is kept after all.
func (l *connLimitListener) evictLocked(pick func(*limitedConn) bool) bool {
	var candidates []*limitedConn
	for c := range l.conns {
		if c.closing || !c.reading || c.phase == phaseBusy || !pick(c) {
			continue
		}
		candidates = append(candidates, c)
	}
	slices.SortFunc(candidates, func(a, b *limitedConn) int {
		switch {
		case waitedLonger(a, b):
			return -1
		case waitedLonger(b, a):
			return 1
		}
		return 0
	})
	for _, c := range candidates {
		// The kernel's socket buffer is where a request waits for a
		// goroutine busy elsewhere: with bytes there, the client is not
		// the one keeping us waiting.
		if hasUnread(c.Conn) {
			continue
		}
		c.closing = true
		l.closing++
		l.evicted++
		_ = c.Conn.SetReadDeadline(time.Unix(1, 0))
		return true
	}
	return false
}

// waitedLonger orders closing candidates: an idle keep-alive costs its
// client only a reconnect, so idle ones go first, longest idle first;
// then the connections whose request has been arriving the longest.
func waitedLonger(a, b *limitedConn) bool {
	if (a.phase == phaseIdle) != (b.phase == phaseIdle) {
		return a.phase == phaseIdle
	}
	return a.since.Before(b.since)
}

// refuseEarly answers 503 to a connection bound for the reserve whose
// request has arrived whole and is not a probe, and closes it; it says
// whether it did. It is guard's refusal made in the accept loop, at the
// cost of a few system calls instead of a goroutine, a read and a handler:
// during a storm the kernel's accept queue, where a probe waits its turn,
// drains as fast as it fills. Anything else (a probe, a request still
// arriving, one with a body) goes to the reserve and guard.
func (l *connLimitListener) refuseEarly(nc net.Conn) bool {
	n := peek(nc, l.peekBuf)
	path, ok := bodilessGET(l.peekBuf[:n])
	if !ok || slices.Contains(l.probes, path) {
		return false
	}
	// Take the request out of the socket, so that closing it sends the
	// client an orderly end after the answer rather than a reset.
	if _, err := io.ReadFull(nc, l.peekBuf[:n]); err != nil {
		_ = nc.Close()
		return true
	}
	// A fresh socket's send buffer takes the answer at once; the deadline
	// only bounds a broken one.
	_ = nc.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = nc.Write(l.refusal)
	_ = nc.Close()
	l.refusedOne()
	return true
}

// A request beyond the limit that is not a probe is answered 503 with
// this body and Retry-After. A scrape holds its slot for milliseconds; a
// second later one is likely free.
const (
	refusalBody = "too many connections: only probes are served now\n"
	retryAfter  = "1"
)

// bodilessGET returns the path a request asks, if b is exactly one whole
// GET request without a body (the request line, headers and the blank line
// that ends them, nothing more).
func bodilessGET(b []byte) (path string, ok bool) {
	head, rest, found := bytes.Cut(b, []byte("\r\n\r\n"))
	if !found || len(rest) > 0 {
		return "", false
	}
	line, fields, _ := bytes.Cut(head, []byte("\r\n"))
	method, rest1, ok1 := strings.Cut(string(line), " ")
	target, proto, ok2 := strings.Cut(rest1, " ")
	if !ok1 || !ok2 || method != http.MethodGet || !strings.HasPrefix(proto, "HTTP/1.") || !strings.HasPrefix(target, "/") {
		return "", false
	}
	for f := range bytes.SplitSeq(fields, []byte("\r\n")) {
		name, _, _ := bytes.Cut(f, []byte(":"))
		if bytes.EqualFold(name, []byte("Content-Length")) || bytes.EqualFold(name, []byte("Transfer-Encoding")) {
			return "", false
		}
	}
	path, _, _ = strings.Cut(target, "?")
	return path, true
}

// noteSaturatedLocked notes whether a connection found every slot outside
// the reserve taken, and says whether that has just begun.
func (l *connLimitListener) noteSaturatedLocked(full bool) (warn bool) {
	if l.saturated || !full {
		return false
	}
	l.saturated, l.evicted, l.refused, l.waits = true, 0, 0, 0
	return true
}

func (l *connLimitListener) logSaturated(warn bool) {
	if warn {
		l.log.Warn("HTTP connection limit reached; beyond it only probes are served (others get 503), and connections waiting on their clients are closed to admit new ones",
			"limit", l.max, "kept_for_probes", l.reserve)
	}
}

// refusedOne counts a request refused from the reserve.
func (l *connLimitListener) refusedOne() {
	l.mu.Lock()
	l.refused++
	l.mu.Unlock()
}

func (l *connLimitListener) forget(c *limitedConn) {
	l.mu.Lock()
	if _, ok := l.conns[c]; !ok {
		l.mu.Unlock()
		return
	}
	delete(l.conns, c)
	if c.reserved {
		l.reserved--
	} else {
		l.shared--
	}
	if c.closing {
		l.closing--
	}
	l.cond.Broadcast()
	// Half the limit, so a crowd hovering at the limit is reported once.
	recovered := l.saturated && len(l.conns) <= l.max/2
	open, evicted, refused, waits := len(l.conns), l.evicted, l.refused, l.waits
	if recovered {
		l.saturated = false
	}
	l.mu.Unlock()
	if recovered {
		l.log.Info("HTTP connections back under half the limit",
			"open", open, "limit", l.max, "closed_to_admit_others", evicted, "refused_beyond_limit", refused, "accept_waits", waits)
	}
}

func (l *connLimitListener) setPhase(c *limitedConn, p connPhase) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.conns[c]; !ok || c.phase == p {
		return
	}
	c.phase, c.since = p, time.Now()
}

// Close implements [net.Listener.Close].
func (l *connLimitListener) Close() error {
	l.mu.Lock()
	l.closed = true
	l.cond.Broadcast()
	l.mu.Unlock()
	return l.Listener.Close()
}

// connState is the server's ConnState hook.
func (l *connLimitListener) connState(nc net.Conn, st http.ConnState) {
	c, ok := nc.(*limitedConn)
	if !ok {
		return
	}
	switch st {
	case http.StateActive, http.StateHijacked:
		l.setPhase(c, phaseBusy)
	case http.StateIdle:
		l.setPhase(c, phaseIdle)
	}
}

type limitedConnKey struct{}

// connContext is the server's ConnContext hook: it lets guard find the
// connection a request came on.
func (l *connLimitListener) connContext(ctx context.Context, nc net.Conn) context.Context {
	if c, ok := nc.(*limitedConn); ok {
		return context.WithValue(ctx, limitedConnKey{}, c)
	}
	return ctx
}

// guard serves h within the limits. A request on a connection of the
// probes' reserve is served only if it is a probe (its path is one of
// probes) and is refused otherwise, with 503 and Retry-After: a client
// told to come back is better off than one hung up on. Either way that
// connection closes after its request, giving the slot back.
//
// guard also bounds request bodies and marks a connection as owing a body
// until its handler has read it, because ConnState calls a connection
// active as soon as the headers are in, and a client dribbling its body
// must be as closable as one dribbling its headers.
func (l *connLimitListener) guard(h http.Handler, maxBody int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, _ := r.Context().Value(limitedConnKey{}).(*limitedConn)
		if c != nil && c.reserved {
			w.Header().Set("Connection", "close")
			if !slices.Contains(l.probes, r.URL.Path) {
				l.refusedOne()
				w.Header().Set("Retry-After", retryAfter)
				w.Header().Set("Content-Type", "text/plain; charset=utf-8")
				w.WriteHeader(http.StatusServiceUnavailable)
				_, _ = io.WriteString(w, refusalBody)
				return
			}
		}
		if r.Body == nil || r.Body == http.NoBody {
			h.ServeHTTP(w, r)
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		if c != nil {
			l.setPhase(c, phaseBody)
			r.Body = &bodyWatch{ReadCloser: r.Body, c: c}
		}
		h.ServeHTTP(w, r)
	})
}

// bodyWatch marks its connection busy again once the body has been read.
// A body its handler leaves unread keeps the mark, rightly: the server
// reads what is left of it before the connection can be idle.
type bodyWatch struct {
	io.ReadCloser
	c    *limitedConn
	done sync.Once
}

func (b *bodyWatch) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.done.Do(func() { b.c.l.setPhase(b.c, phaseBusy) })
	}
	return n, err
}

// limitedConn gives its slot back when closed, and tells its listener
// when the server waits to read it. Its fields after reserved are guarded
// by the listener's mutex.
type limitedConn struct {
	net.Conn
	l        *connLimitListener
	reserved bool // in the probes' reserve; set at Accept

	phase        connPhase
	since        time.Time // when it entered its phase
	reading      bool      // the server is in a Read of it
	closing      bool      // chosen to be closed; its reader closes it
	readDeadline time.Time // the server's, while closing replaces it
}

// Read implements [net.Conn.Read]. While it waits, the connection waits
// on its client and may be closed to admit another, by this very Read
// (see evictLocked).
func (c *limitedConn) Read(p []byte) (int, error) {
	l := c.l
	l.mu.Lock()
	c.reading = true
	if l.waiting > 0 {
		l.cond.Broadcast() // it may be closable now
	}
	l.mu.Unlock()
	n, err := c.Conn.Read(p)
	l.mu.Lock()
	c.reading = false
	evict := c.closing
	if evict && n > 0 {
		// The request came before the eviction took effect: keep it.
		c.closing = false
		l.closing--
		l.evicted--
		_ = c.Conn.SetReadDeadline(c.readDeadline)
		l.cond.Broadcast()
		evict = false
	}
	l.mu.Unlock()
	if evict {
		_ = c.Close()
	}
	return n, err
}

// SetReadDeadline implements [net.Conn.SetReadDeadline], leaving in place
// the past deadline that wakes a connection chosen to be closed.
func (c *limitedConn) SetReadDeadline(t time.Time) error {
	c.l.mu.Lock()
	defer c.l.mu.Unlock()
	c.readDeadline = t
	if c.closing {
		return nil
	}
	return c.Conn.SetReadDeadline(t)
}

// SetDeadline implements [net.Conn.SetDeadline]; see SetReadDeadline.
func (c *limitedConn) SetDeadline(t time.Time) error {
	if err := c.SetReadDeadline(t); err != nil {
		return err
	}
	return c.Conn.SetWriteDeadline(t)
}

func (c *limitedConn) Close() error {
	// Close first, so the count never shows fewer descriptors than are open.
	err := c.Conn.Close()
	c.l.forget(c)
	return err
}

// CloseWrite keeps what net/http finds on a *net.TCPConn: it half-closes
// before hanging up on a request it refused, so that the client reads the
// refusal rather than a reset.
func (c *limitedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.ErrUnsupported
}
