package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
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

// httpServerConfig bounds every phase of an HTTP exchange and how many
// exchanges may be open at once. Tests shrink the timeouts to milliseconds.
type httpServerConfig struct {
	ReadHeaderTimeout time.Duration // accept (or first byte of a keep-alive request) to end of headers
	ReadTimeout       time.Duration // start of a request to end of its body
	WriteTimeout      time.Duration // end of request headers to end of response
	IdleTimeout       time.Duration // keep-alive wait for the next request
	MaxHeaderBytes    int
	MaxBodyBytes      int64
	MaxConns          int
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
	}
}

// newHTTPServer listens on addr and returns a server for h whose
// connections the returned listener caps; pass that listener to Serve.
// The server's ConnState and ConnContext hooks belong to the listener.
func newHTTPServer(addr string, h http.Handler, cfg httpServerConfig, log *slog.Logger) (*http.Server, *connLimitListener, error) {
	if cfg.MaxConns < 1 {
		return nil, nil, fmt.Errorf("HTTP connection limit %d: want at least 1", cfg.MaxConns)
	}
	inner, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	ln := newConnLimitListener(inner, cfg.MaxConns, log)
	srv := &http.Server{
		Handler:           ln.watchBodies(h, cfg.MaxBodyBytes),
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

// connPhase is where a connection stands, as far as deciding which one to
// give up when the limit is reached.
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
	// phaseEvicting: chosen to be closed; not to be chosen again.
	phaseEvicting
)

// connLimitListener keeps at most max connections open. Admitting a new
// connection must not wait for a timeout to expire somewhere, or a
// crowd of idle or slow clients would starve the kubelet's liveness probe.
// So when an arrival fills the last slot, the listener closes the
// connection that has waited longest for its client (idle keep-alives first,
// as their clients reconnect transparently; then connections still sending
// a request), keeping a slot free for whoever comes next. A connection
// the agent is working on is never closed: if all of them are busy, Accept
// waits, and new clients wait in the kernel's backlog, where they hold no
// descriptor of ours.
type connLimitListener struct {
	net.Listener
	max int
	log *slog.Logger

	mu        sync.Mutex
	cond      sync.Cond // signalled when a slot may have come free
	conns     map[*limitedConn]struct{}
	accepting int // Accept calls holding a slot for the connection they wait for
	newest    *limitedConn
	peak      int
	closed    bool

	// One warning when the limit is reached and one note when the crowd
	// has gone, rather than a line per connection.
	saturated bool
	evicted   int
	waits     int
}

func newConnLimitListener(inner net.Listener, limit int, log *slog.Logger) *connLimitListener {
	l := &connLimitListener{Listener: inner, max: limit, log: log, conns: make(map[*limitedConn]struct{})}
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

func (l *connLimitListener) Accept() (net.Conn, error) {
	if err := l.reserve(); err != nil {
		return nil, err
	}
	nc, err := l.Listener.Accept()
	l.mu.Lock()
	l.accepting--
	if err != nil {
		l.cond.Broadcast()
		l.mu.Unlock()
		return nil, err
	}
	c := &limitedConn{Conn: nc, l: l, phase: phaseNew, since: time.Now()}
	l.conns[c] = struct{}{}
	l.newest = c
	l.peak = max(l.peak, len(l.conns))
	victim, warn := l.makeRoomLocked()
	l.mu.Unlock()
	l.logSaturated(warn)
	if victim != nil {
		_ = victim.Close()
	}
	return c, nil
}

// reserve takes a slot for the connection about to be accepted.
func (l *connLimitListener) reserve() error {
	l.mu.Lock()
	waited := false
	for {
		if l.closed {
			l.mu.Unlock()
			return net.ErrClosed
		}
		if len(l.conns)+l.accepting < l.max {
			l.accepting++
			l.mu.Unlock()
			return nil
		}
		// Full because the last arrival found nothing to close; something
		// may have become closable since.
		if victim, warn := l.makeRoomLocked(); victim != nil || warn {
			l.mu.Unlock()
			l.logSaturated(warn)
			if victim != nil {
				_ = victim.Close()
			}
			l.mu.Lock()
			continue
		}
		if !waited {
			waited = true
			l.waits++
		}
		l.cond.Wait()
	}
}

// makeRoomLocked picks the connection to close when every slot is taken,
// if any may be closed, and says whether the limit has just been reached.
func (l *connLimitListener) makeRoomLocked() (victim *limitedConn, warn bool) {
	if len(l.conns)+l.accepting < l.max {
		return nil, false
	}
	if !l.saturated {
		l.saturated, l.evicted, l.waits, warn = true, 0, 0, true
	}
	for c := range l.conns {
		switch {
		case c.phase == phaseBusy || c.phase == phaseEvicting:
			continue
		case c == l.newest && c.phase != phaseIdle:
			// Its client has only just connected; the arrival after it
			// may close it if it is still not through its request.
			continue
		case victim == nil, waitedLonger(c, victim):
			victim = c
		}
	}
	if victim != nil {
		victim.phase = phaseEvicting
		l.evicted++
	}
	return victim, warn
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

func (l *connLimitListener) logSaturated(warn bool) {
	if warn {
		l.log.Warn("HTTP connection limit reached; closing the connections that have waited longest for their clients to admit new ones",
			"limit", l.max)
	}
}

func (l *connLimitListener) forget(c *limitedConn) {
	l.mu.Lock()
	if _, ok := l.conns[c]; !ok {
		l.mu.Unlock()
		return
	}
	delete(l.conns, c)
	l.cond.Broadcast()
	// Half the limit, so a crowd hovering at the limit is reported once.
	recovered := l.saturated && len(l.conns) <= l.max/2
	open, evicted, waits := len(l.conns), l.evicted, l.waits
	if recovered {
		l.saturated = false
	}
	l.mu.Unlock()
	if recovered {
		l.log.Info("HTTP connections back under half the limit",
			"open", open, "limit", l.max, "closed_to_admit_others", evicted, "accept_waits", waits)
	}
}

func (l *connLimitListener) setPhase(c *limitedConn, p connPhase) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.conns[c]; !ok || c.phase == phaseEvicting || c.phase == p {
		return
	}
	c.phase, c.since = p, time.Now()
	if p == phaseIdle || p == phaseBody {
		l.cond.Broadcast()
	}
}

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

// connContext is the server's ConnContext hook: it lets watchBodies find
// the connection a request came on.
func (l *connLimitListener) connContext(ctx context.Context, nc net.Conn) context.Context {
	if c, ok := nc.(*limitedConn); ok {
		return context.WithValue(ctx, limitedConnKey{}, c)
	}
	return ctx
}

// watchBodies bounds request bodies and marks a connection as owing a body
// until its handler has read it, because ConnState calls a connection
// active as soon as the headers are in, and a client dribbling its body
// must be as closable as one dribbling its headers.
func (l *connLimitListener) watchBodies(h http.Handler, maxBody int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body == nil || r.Body == http.NoBody {
			h.ServeHTTP(w, r)
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		if c, ok := r.Context().Value(limitedConnKey{}).(*limitedConn); ok {
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

// limitedConn gives its slot back when closed. Its phase and since are
// guarded by the listener's mutex.
type limitedConn struct {
	net.Conn
	l     *connLimitListener
	phase connPhase
	since time.Time // when it entered its phase
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
