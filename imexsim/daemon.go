package imexsim

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// PeerStatus is what a daemon knows of one node of its list.
type PeerStatus string

// The peer statuses, as nvidia-imex-ctl -N prints them here (the real
// program prints a table of its own).
const (
	// PeerSelf is the daemon's own entry.
	PeerSelf PeerStatus = "SELF"
	// PeerConnected: its daemon answered with the same node list.
	PeerConnected PeerStatus = "CONNECTED"
	// PeerUnavailable: no daemon answers at its address (yet).
	PeerUnavailable PeerStatus = "UNAVAILABLE"
	// PeerInvalid: a daemon answers, but with another node list: it is
	// of another domain, and the two refuse each other.
	PeerInvalid PeerStatus = "INVALID"
	// PeerUnmapped: its name does not resolve (a DNS-names slot no pod
	// fills); it does not count against the quorum.
	PeerUnmapped PeerStatus = "UNMAPPED"
)

// Options tune a Daemon; the zero value is a daemon as nvidia-imex runs.
type Options struct {
	// Resolve looks up a node list entry's address (default: the first
	// address net.DefaultResolver finds, which reads /etc/hosts as the
	// real daemon does).
	Resolve func(ctx context.Context, host string) (string, error)
	// Interval is how often peers are asked (default 1 s).
	Interval time.Duration
	// Logger receives what the daemon does (default: discarded).
	Logger *slog.Logger
}

// Daemon is the stand-in IMEX daemon of one node.
type Daemon struct {
	cfg  Config
	opts Options
	log  *slog.Logger

	mu    sync.Mutex
	nodes Nodes
	key   string
	peers []peer // one per node list entry, in its order
	// changed is closed, and replaced, whenever a peer's status or the
	// list changes (Wait).
	changed chan struct{}
	// ready is what Ready said last, to log when it turns.
	ready bool
	// listening is closed once Run listens on its ports.
	listening chan struct{}
}

// Listening is closed once Run serves peers and commands.
func (d *Daemon) Listening() <-chan struct{} { return d.listening }

type peer struct {
	node   string
	addr   string
	status PeerStatus
	err    string
}

// New reads the config's node list; the daemon is the entry whose address
// is BIND_INTERFACE_IP (which must be set: the stand-in does not guess
// among the host's interfaces).
func New(cfg Config, opts Options) (*Daemon, error) {
	if opts.Resolve == nil {
		opts.Resolve = func(ctx context.Context, host string) (string, error) {
			addrs, err := net.DefaultResolver.LookupHost(ctx, host)
			if err != nil {
				return "", err
			}
			return addrs[0], nil
		}
	}
	if opts.Interval <= 0 {
		opts.Interval = time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.BindIP == "" {
		return nil, errors.New("BIND_INTERFACE_IP: the stand-in needs it set to this node's address in the node list")
	}
	d := &Daemon{cfg: cfg, opts: opts, log: opts.Logger, changed: make(chan struct{}), listening: make(chan struct{})}
	if err := d.Reload(context.Background()); err != nil {
		return nil, err
	}
	return d, nil
}

// Reload rereads the node list and resolves its entries again, as the
// real daemon does on SIGUSR1: a peer whose address changed is asked anew.
func (d *Daemon) Reload(ctx context.Context) error {
	f, err := os.Open(d.cfg.NodeConfigFile)
	if err != nil {
		return fmt.Errorf("IMEX_NODE_CONFIG_FILE: %w", err)
	}
	defer f.Close()
	nodes, err := ParseNodes(f)
	if err != nil {
		return fmt.Errorf("IMEX_NODE_CONFIG_FILE %s: %w", d.cfg.NodeConfigFile, err)
	}
	peers := make([]peer, len(nodes))
	self := -1
	for i, node := range nodes {
		peers[i] = peer{node: node, status: PeerUnmapped}
		addr, err := d.opts.Resolve(ctx, node)
		if err != nil {
			peers[i].err = err.Error()
			continue
		}
		peers[i].addr, peers[i].status = addr, PeerUnavailable
		if addr == d.cfg.BindIP {
			self = i
			peers[i].status = PeerSelf
		}
	}
	if self < 0 {
		return fmt.Errorf("IMEX_NODE_CONFIG_FILE %s: no entry is this node (BIND_INTERFACE_IP %s)", d.cfg.NodeConfigFile, d.cfg.BindIP)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	// A peer at an unchanged address keeps its status until asked again.
	for i := range peers {
		for _, old := range d.peers {
			if old.node == peers[i].node && old.addr == peers[i].addr && peers[i].status == PeerUnavailable {
				peers[i].status, peers[i].err = old.status, old.err
			}
		}
	}
	d.nodes, d.key, d.peers = nodes, nodes.Key(), peers
	d.log.Info("imex stand-in: node list read", "nodes", len(nodes), "self", nodes[self])
	d.notify()
	return nil
}

// notify wakes Wait and logs a turn of readiness; callers hold d.mu.
func (d *Daemon) notify() {
	close(d.changed)
	d.changed = make(chan struct{})
	if r := d.readyLocked(); r != d.ready {
		d.ready = r
		if r {
			d.log.Info("imex stand-in: READY")
		} else {
			d.log.Info("imex stand-in: UNAVAILABLE")
		}
	}
}

// Wait returns once cond holds, checking it at every change of the
// daemon's peers or list, or ctx's error when it ends first.
func (d *Daemon) Wait(ctx context.Context, cond func() bool) error {
	for {
		d.mu.Lock()
		ch := d.changed
		d.mu.Unlock()
		if cond() {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Ready reports whether the daemon would answer READY: with
// IMEX_WAIT_FOR_QUORUM=NONE at once, otherwise once every listed node
// whose name resolves runs a daemon with the same node list.
func (d *Daemon) Ready() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.readyLocked()
}

func (d *Daemon) readyLocked() bool {
	if d.cfg.WaitForQuorum == QuorumNone {
		return true
	}
	return !slices.ContainsFunc(d.peers, func(p peer) bool {
		return p.status == PeerUnavailable || p.status == PeerInvalid
	})
}

// Peers returns what the daemon knows of each node of its list.
func (d *Daemon) Peers() map[string]PeerStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]PeerStatus{}
	for _, p := range d.peers {
		out[p.node] = p.status
	}
	return out
}

// Run serves peers on SERVER_PORT and nvidia-imex-ctl on IMEX_CMD_PORT,
// asks the other nodes' daemons every Interval, and rereads the node list
// whenever reload receives, until ctx ends.
func (d *Daemon) Run(ctx context.Context, reload <-chan struct{}) error {
	var lc net.ListenConfig
	peerLn, err := lc.Listen(ctx, "tcp", net.JoinHostPort(d.cfg.BindIP, strconv.Itoa(d.cfg.ServerPort)))
	if err != nil {
		return fmt.Errorf("SERVER_PORT: %w", err)
	}
	defer peerLn.Close()
	var cmdLn net.Listener
	if d.cfg.CmdEnabled {
		cmdLn, err = lc.Listen(ctx, "tcp", net.JoinHostPort(d.cfg.CmdBindIP, strconv.Itoa(d.cfg.CmdPort)))
		if err != nil {
			return fmt.Errorf("IMEX_CMD_PORT: %w", err)
		}
		defer cmdLn.Close()
	}
	close(d.listening)
	d.log.Info("imex stand-in: listening", "server", peerLn.Addr(), "commands", d.cfg.CmdEnabled)
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Go(func() { d.accept(ctx, peerLn, d.answerPeer) })
	if cmdLn != nil {
		wg.Go(func() { d.accept(ctx, cmdLn, d.answerCmd) })
	}
	go func() { <-ctx.Done(); peerLn.Close(); closeIf(cmdLn) }()

	tick := time.NewTicker(d.opts.Interval)
	defer tick.Stop()
	for {
		d.askPeers(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-reload:
			if err := d.Reload(ctx); err != nil {
				// The old list stays in force, as a bad edit must not
				// take a running domain down.
				d.log.Error("imex stand-in: reload failed", "err", err)
			}
		case <-tick.C:
		}
	}
}

func closeIf(l net.Listener) {
	if l != nil {
		l.Close()
	}
}

func (d *Daemon) accept(ctx context.Context, ln net.Listener, answer func(string) string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			line, err := bufio.NewReader(c).ReadString('\n')
			if err != nil || ctx.Err() != nil {
				return
			}
			fmt.Fprint(c, answer(strings.TrimSpace(line)))
		}()
	}
}

// The peer protocol: "HELLO <node list key>" answered "OK" or "REFUSED
// <why>". Own to the stand-in; the real daemons speak gRPC.
func (d *Daemon) answerPeer(line string) string {
	key, ok := strings.CutPrefix(line, "HELLO ")
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case !ok:
		return "REFUSED not a hello\n"
	case key != d.key:
		return "REFUSED another node list\n"
	}
	return "OK\n"
}

// answerCmd answers nvidia-imex-ctl: QUERY (READY or UNAVAILABLE) and
// NODES (one line per node list entry).
func (d *Daemon) answerCmd(line string) string {
	switch line {
	case "QUERY":
		if d.Ready() {
			return "READY\n"
		}
		return "UNAVAILABLE\n"
	case "NODES":
		d.mu.Lock()
		defer d.mu.Unlock()
		var b strings.Builder
		for i, p := range d.peers {
			fmt.Fprintf(&b, "Node #%d - %s - %s\n", i, p.node, p.status)
		}
		return b.String()
	}
	return "ERROR unknown command\n"
}

// askPeers says hello to every other resolvable node of the list.
func (d *Daemon) askPeers(ctx context.Context) {
	d.mu.Lock()
	peers := slices.Clone(d.peers)
	key := d.key
	d.mu.Unlock()
	for i, p := range peers {
		if p.status == PeerSelf || p.status == PeerUnmapped {
			continue
		}
		peers[i].status, peers[i].err = d.hello(ctx, p.addr, key)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.key != key {
		return // reloaded meanwhile: the new list is asked next round
	}
	changed := false
	for i := range d.peers {
		if d.peers[i].status != PeerSelf && d.peers[i].status != PeerUnmapped {
			if d.peers[i].status != peers[i].status {
				changed = true
				d.log.Info("imex stand-in: peer", "node", peers[i].node, "status", peers[i].status, "err", peers[i].err)
			}
			d.peers[i].status, d.peers[i].err = peers[i].status, peers[i].err
		}
	}
	if changed {
		d.notify()
	}
}

func (d *Daemon) hello(ctx context.Context, addr, key string) (PeerStatus, string) {
	dctx, cancel := context.WithTimeout(ctx, d.opts.Interval+time.Second)
	defer cancel()
	var dialer net.Dialer
	c, err := dialer.DialContext(dctx, "tcp", net.JoinHostPort(addr, strconv.Itoa(d.cfg.ServerPort)))
	if err != nil {
		return PeerUnavailable, err.Error()
	}
	defer c.Close()
	if dl, ok := dctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	}
	if _, err := fmt.Fprintf(c, "HELLO %s\n", key); err != nil {
		return PeerUnavailable, err.Error()
	}
	answer, err := bufio.NewReader(c).ReadString('\n')
	switch {
	case err != nil:
		return PeerUnavailable, err.Error()
	case strings.TrimSpace(answer) == "OK":
		return PeerConnected, ""
	}
	return PeerInvalid, strings.TrimSpace(answer)
}

// Ask sends one nvidia-imex-ctl command (QUERY or NODES) to the daemon of
// cfg (IMEX_CMD_BIND_INTERFACE_IP:IMEX_CMD_PORT) and returns its answer.
func Ask(ctx context.Context, cfg Config, command string) (string, error) {
	if !cfg.CmdEnabled {
		return "", errors.New("IMEX_CMD_ENABLED=0: the daemon takes no commands")
	}
	addr := net.JoinHostPort(cfg.CmdBindIP, strconv.Itoa(cfg.CmdPort))
	var dialer net.Dialer
	c, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", fmt.Errorf("IMEX daemon at %s: %w", addr, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(c, "%s\n", command); err != nil {
		return "", err
	}
	var b strings.Builder
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		b.WriteString(sc.Text() + "\n")
	}
	return b.String(), sc.Err()
}
