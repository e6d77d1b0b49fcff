package imexsim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParseConfig(t *testing.T) {
	// The settings NVIDIA's compute domain daemon renders, and some it
	// leaves to the daemon.
	good := `# IMEX config
SERVER_PORT=50000
IMEX_CMD_PORT=50005
IMEX_CMD_BIND_INTERFACE_IP=10.1.2.3
IMEX_NODE_CONFIG_FILE=/imexd/nodes.cfg
IMEX_WAIT_FOR_QUORUM=RECOVERY
IMEX_ENABLE_AUTH_ENCRYPTION=0
LOG_LEVEL=4

BIND_INTERFACE_IP=
`
	c, err := ParseConfig(strings.NewReader(good))
	if err != nil {
		t.Fatal(err)
	}
	if c.ServerPort != 50000 || c.CmdPort != 50005 || c.CmdBindIP != "10.1.2.3" || c.NodeConfigFile != "/imexd/nodes.cfg" ||
		c.WaitForQuorum != QuorumRecovery || !c.CmdEnabled || c.BindIP != "" || c.Other["LOG_LEVEL"] != "4" {
		t.Errorf("config %+v", c)
	}
	for _, tt := range []struct{ text, want string }{
		{"SERVER_PORT=0", `line 1: SERVER_PORT="0": want a TCP port`},
		{"\n\nIMEX_CMD_PORT=http", `line 3: IMEX_CMD_PORT="http"`},
		{"IMEX_WAIT_FOR_QUORUM=ALL", "want RECOVERY or NONE"},
		{"IMEX_CMD_ENABLED=yes", "want 0 or 1"},
		{"BIND_INTERFACE_IP=node-1", "want an IPv4 or IPv6 address"},
		{"SERVER_PORT=1\nSERVER_PORT=2", "line 2: SERVER_PORT given again (first on line 1)"},
		{"server_port=1", "want KEY=VALUE"},
		{"just words", "want KEY=VALUE"},
	} {
		if _, err := ParseConfig(strings.NewReader(tt.text)); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseConfig(%q): %v, want %q", tt.text, err, tt.want)
		}
	}
}

func TestParseNodes(t *testing.T) {
	n, err := ParseNodes(strings.NewReader("# domain\n10.0.0.1\ncompute-domain-daemon-0001\n\n  fd00::2  \n"))
	if err != nil || strings.Join(n, ",") != "10.0.0.1,compute-domain-daemon-0001,fd00::2" {
		t.Fatalf("ParseNodes = %q, %v", n, err)
	}
	for _, tt := range []struct{ text, want string }{
		{"10.0.0.1\n10.0.0.1", "line 2: 10.0.0.1 listed again (first on line 1)"},
		{"node_1", `line 1: "node_1": want an IP address or a host name`},
		{"-bad", "want an IP address or a host name"},
		{"a b", "want an IP address or a host name"},
	} {
		if _, err := ParseNodes(strings.NewReader(tt.text)); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseNodes(%q): %v, want %q", tt.text, err, tt.want)
		}
	}
	a, _ := ParseNodes(strings.NewReader("10.0.0.1\n10.0.0.2"))
	b, _ := ParseNodes(strings.NewReader("10.0.0.2\n10.0.0.1"))
	if a.Key() == b.Key() {
		t.Error("two node maps, one key")
	}
}

func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{"SERVER_PORT=50000\nIMEX_CMD_PORT=50005\n", "# x\nA=\nB=c=d\n", "IMEX_WAIT_FOR_QUORUM=NONE", "=1", "A"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(strings.NewReader(string(data)))
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			return
		}
		if c.ServerPort < 1 || c.ServerPort > 65535 || c.CmdPort < 1 || c.CmdPort > 65535 || net.ParseIP(c.CmdBindIP) == nil ||
			c.WaitForQuorum != QuorumRecovery && c.WaitForQuorum != QuorumNone || c.NodeConfigFile == "" {
			t.Fatalf("accepted %+v", c)
		}
	})
}

func FuzzParseNodes(f *testing.F) {
	for _, s := range []string{"10.0.0.1\n10.0.0.2\n", "compute-domain-daemon-0000\n#x\n", "a..b", "::1\n::1"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		n, err := ParseNodes(strings.NewReader(string(data)))
		if err != nil {
			return
		}
		seen := map[string]bool{}
		for _, node := range n {
			if seen[node] || node == "" || strings.ContainsAny(node, " \t#\n") {
				t.Fatalf("accepted %q", n)
			}
			seen[node] = true
		}
	})
}

// freePort finds a TCP port free on 127.0.0.1; the daemons of a test all
// use it, each on its own loopback address, as nodes share SERVER_PORT.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

type testNode struct {
	d      *Daemon
	cfg    Config
	reload chan struct{}
	stop   context.CancelFunc
	done   chan error
}

// startNode runs a daemon at ip with list as its node list.
func startNode(t *testing.T, ip string, port, cmdPort int, list []string, resolve func(context.Context, string) (string, error)) *testNode {
	t.Helper()
	nodesFile := filepath.Join(t.TempDir(), "nodes.cfg")
	if err := os.WriteFile(nodesFile, []byte(strings.Join(list, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := ParseConfig(strings.NewReader(fmt.Sprintf("SERVER_PORT=%d\nBIND_INTERFACE_IP=%s\nIMEX_CMD_BIND_INTERFACE_IP=%s\nIMEX_CMD_PORT=%d\nIMEX_NODE_CONFIG_FILE=%s\n",
		port, ip, ip, cmdPort, nodesFile)))
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(cfg, Options{Interval: 20 * time.Millisecond, Resolve: resolve})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	n := &testNode{d: d, cfg: cfg, reload: make(chan struct{}), stop: cancel, done: make(chan error, 1)}
	go func() { n.done <- d.Run(ctx, n.reload) }()
	t.Cleanup(func() { n.halt(t) })
	select {
	case <-d.Listening():
	case err := <-n.done:
		t.Fatalf("daemon at %s: %v", ip, err)
	}
	return n
}

func (n *testNode) halt(t *testing.T) {
	n.stop()
	if err := <-n.done; err != nil {
		t.Errorf("daemon: %v", err)
	}
	n.done <- nil // a second halt returns at once
}

func waitFor(t *testing.T, n *testNode, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := n.d.Wait(ctx, cond); err != nil {
		t.Fatalf("waiting for %s: %v; peers %v", what, err, n.d.Peers())
	}
}

func query(t *testing.T, n *testNode) string {
	t.Helper()
	out, err := Ask(context.Background(), n.cfg, "QUERY")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// Three nodes form a quorum; a daemon of another node list is refused by
// them; a node that stops takes the others out of quorum until a reload
// drops it from their list.
func TestQuorum(t *testing.T) {
	port, cmd := freePort(t), freePort(t)
	list := []string{"127.0.0.1", "127.0.0.2", "127.0.0.3"}
	a := startNode(t, "127.0.0.1", port, cmd, list, nil)
	waitFor(t, a, "a to find its peers missing", func() bool { return a.d.Peers()["127.0.0.2"] == PeerUnavailable })
	if got := query(t, a); got != "UNAVAILABLE" {
		t.Fatalf("alone: %s", got)
	}
	b := startNode(t, "127.0.0.2", port, cmd, list, nil)
	c := startNode(t, "127.0.0.3", port, cmd, list, nil)
	for _, n := range []*testNode{a, b, c} {
		waitFor(t, n, "quorum", n.d.Ready)
		if got := query(t, n); got != "READY" {
			t.Errorf("%s: %s", n.cfg.BindIP, got)
		}
	}
	out, err := Ask(context.Background(), a.cfg, "NODES")
	if err != nil || out != "Node #0 - 127.0.0.1 - SELF\nNode #1 - 127.0.0.2 - CONNECTED\nNode #2 - 127.0.0.3 - CONNECTED\n" {
		t.Errorf("NODES: %q, %v", out, err)
	}

	// Another domain's daemon, listing a, is refused: no cross-domain peer.
	x := startNode(t, "127.0.0.4", port, cmd, []string{"127.0.0.4", "127.0.0.1"}, nil)
	waitFor(t, x, "x refused", func() bool { return x.d.Peers()["127.0.0.1"] == PeerInvalid })
	if x.d.Ready() {
		t.Error("a daemon of another node list is in quorum")
	}

	// c stops: a and b lose quorum.
	c.halt(t)
	waitFor(t, a, "a to lose c", func() bool { return !a.d.Ready() })
	// Dropped from the list and reloaded, as NVIDIA's daemon signals
	// nvidia-imex on a change: back in quorum.
	if err := os.WriteFile(a.cfg.NodeConfigFile, []byte("127.0.0.1\n127.0.0.2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a.reload <- struct{}{}
	// b still lists c and another list: a is ready only once b agrees.
	waitFor(t, a, "a to see b's other list", func() bool { return a.d.Peers()["127.0.0.2"] == PeerInvalid })
	if err := os.WriteFile(b.cfg.NodeConfigFile, []byte("127.0.0.1\n127.0.0.2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	b.reload <- struct{}{}
	waitFor(t, a, "a back in quorum", a.d.Ready)
	waitFor(t, b, "b back in quorum", b.d.Ready)
}

// Names that do not resolve (DNS-name slots no daemon fills) do not count
// against the quorum; once mapped, they do.
func TestUnmappedNames(t *testing.T) {
	port, cmd := freePort(t), freePort(t)
	hosts := map[string]string{"cd-daemon-0": "127.0.0.1"}
	resolve := func(_ context.Context, h string) (string, error) {
		if a, ok := hosts[h]; ok {
			return a, nil
		}
		return "", errors.New("no such host")
	}
	list := []string{"cd-daemon-0", "cd-daemon-1", "cd-daemon-2"}
	a := startNode(t, "127.0.0.1", port, cmd, list, resolve)
	if !a.d.Ready() || a.d.Peers()["cd-daemon-1"] != PeerUnmapped {
		t.Fatalf("one mapped node: ready %v, peers %v", a.d.Ready(), a.d.Peers())
	}
	hosts["cd-daemon-1"] = "127.0.0.2"
	a.reload <- struct{}{}
	waitFor(t, a, "the mapped peer to count", func() bool { return !a.d.Ready() })
	startNode(t, "127.0.0.2", port, cmd, list, resolve)
	waitFor(t, a, "quorum of the mapped", a.d.Ready)
}

func TestNewRefuses(t *testing.T) {
	nodes := filepath.Join(t.TempDir(), "nodes.cfg")
	os.WriteFile(nodes, []byte("10.9.9.9\n"), 0o644)
	for _, tt := range []struct {
		cfg  Config
		want string
	}{
		{Config{NodeConfigFile: nodes}, "BIND_INTERFACE_IP"},
		{Config{NodeConfigFile: nodes, BindIP: "127.0.0.1"}, "no entry is this node"},
		{Config{NodeConfigFile: nodes + ".missing", BindIP: "127.0.0.1"}, "IMEX_NODE_CONFIG_FILE"},
	} {
		if _, err := New(tt.cfg, Options{}); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("New(%+v): %v, want %q", tt.cfg, err, tt.want)
		}
	}
}
