// Command allocate-overhead measures what gpu-agent adds to the kubelet's
// Allocate and GetPreferredAllocation calls: each agent binary runs `gpu-agent
// run` on a simulated node, and its device plugin is called over its unix
// socket side by side with a bare gRPC device plugin that only answers
// (issue 23: "it must stay fast").
//
//	go build -o /tmp/ga-new ./cmd/gpu-agent   # at the repository root
//	cd test/bench && go run ./cmd/allocate-overhead -agent new=/tmp/ga-new [-agent old=/tmp/ga-old] [-load 2]
//
// Each round measures every agent next to the bare plugin, in pairs (the
// agent, then the bare plugin, or the other way round): -calls Allocate
// calls for one device (cycling over the resource's devices), then -calls
// GetPreferredAllocation calls (every device available, -size wanted), one
// at a time as the kubelet makes them, each target's after -warmup calls
// that are not counted. The order of the pairs rotates from round to round
// and the order within a pair alternates, so drift in the machine's load
// falls on both sides; with -block B the two take turns every B calls, so
// that even drift within a round does. A round's figure for an agent is
// p50(agent)/p50(bare) of that pair; the table gives the median over rounds
// of those ratios, with the median p50 and p99 of each side.
//
// The bare plugin runs in a process of its own, as every device plugin is
// a process apart from the kubelet: served from the client's process, a
// call is a hand-off between goroutines of one Go runtime and takes a
// third of the time (-bare-in-process shows it), which measures the
// process boundary rather than the agent. The columns "CPU per call" are
// the CPU time (user and system, from /proc) each plugin process used
// while its calls were made, divided by the calls.
//
// The agents' Allocate goes through whatever they do before they answer
// (the allocation ledger and its log, from ec5a8e7 on): the bench's
// thousands of allocations are never listed by the fake kubelet's
// pod-resources, which answers no pods, so none is settled and the log only
// grows; the table gives its final size.
//
// -load N runs N busy loops (processes of this command, at the same
// priority as everything else) for the whole measurement: with N at the
// machine's CPU count, every call competes for a CPU.
package main

import (
	"context"
	"debug/buildinfo"
	"encoding/csv"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpu-agent/gpu-agent/test/bench/internal/proc"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type options struct {
	agents        agentFlags
	backend       string
	resource      string
	rounds        int
	calls         int
	warmup        int
	size          int
	load          int
	bareInProcess bool
	csv           string
	only          string
	control       bool
	block         int
	perf          string
	// kinds are the calls made: both, or -only's.
	kinds []string
	// The roles this command runs itself in.
	spin      bool
	serveBare string
	bareIDs   string
}

// agentSpec is one -agent: a binary and the label the table gives it.
type agentSpec struct{ label, path string }

type agentFlags []agentSpec

func (a *agentFlags) String() string { return fmt.Sprint(*a) }

func (a *agentFlags) Set(v string) error {
	label, path, ok := strings.Cut(v, "=")
	if !ok {
		label, path = filepath.Base(v), v
	}
	if label == "" || path == "" {
		return fmt.Errorf("want LABEL=PATH or PATH, got %q", v)
	}
	*a = append(*a, agentSpec{label, path})
	return nil
}

func main() {
	var o options
	flag.Var(&o.agents, "agent", "gpu-agent binary as LABEL=PATH (or PATH, labelled by its base name); repeat for several")
	flag.StringVar(&o.backend, "backend", "sim:dgx-a100", "the agents' --backend, without its state file (one is added where the binary takes it)")
	flag.StringVar(&o.resource, "resource", "nvidia.com/gpu", "resource whose plugin is called")
	flag.IntVar(&o.rounds, "rounds", 30, "rounds")
	flag.IntVar(&o.calls, "calls", 2000, "calls of each kind per target and round")
	flag.IntVar(&o.warmup, "warmup", 100, "calls to each target before its timed calls of a kind, not counted")
	flag.IntVar(&o.block, "block", 0, "the agent and the bare plugin take turns every this many calls within a round (0: all of one's calls, then the other's)")
	flag.IntVar(&o.size, "size", 2, "GetPreferredAllocation's allocation size (every device is available)")
	flag.IntVar(&o.load, "load", 0, "busy-loop processes running during the measurement")
	flag.BoolVar(&o.bareInProcess, "bare-in-process", false, "serve the bare plugin from this process, beside the client, instead of a process of its own")
	flag.StringVar(&o.csv, "csv", "", "also write each round's figures to this CSV file")
	flag.StringVar(&o.perf, "perf", "", "record each plugin process with `perf record -g` during the rounds, into DIR/LABEL.data (needs perf)")
	flag.BoolVar(&o.control, "control", false, "also measure a second bare plugin as if it were an agent: the method's floor, whose ratio should be 1")
	flag.StringVar(&o.only, "only", "", "make only this call, Allocate or GetPreferredAllocation (to profile one)")
	flag.BoolVar(&o.spin, "spin", false, "only spin on one CPU until killed (the -load role)")
	flag.StringVar(&o.serveBare, "serve-bare", "", "only serve the bare plugin on this socket until killed (the bare plugin's role)")
	flag.StringVar(&o.bareIDs, "bare-ids", "", "the bare plugin's device IDs, comma-separated (with -serve-bare)")
	flag.Parse()
	var err error
	switch {
	case o.spin:
		spin()
	case o.serveBare != "":
		err = serveBare(o.serveBare, strings.Split(o.bareIDs, ","))
	default:
		err = run(o)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "allocate-overhead:", err)
		os.Exit(1)
	}
}

// spin keeps one CPU busy.
func spin() {
	runtime.GOMAXPROCS(1)
	x := 0
	for {
		x++
		if x < 0 {
			fmt.Println(x) // never: keeps the loop from being compiled away
		}
	}
}

// serveBare is the bare plugin's role: it serves until SIGTERM, and prints
// a line once it does.
func serveBare(socket string, ids []string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	p, err := startBarePlugin(socket, ids)
	if err != nil {
		return err
	}
	defer p.stop()
	fmt.Println("serving")
	<-ctx.Done()
	return nil
}

func run(o options) error {
	if len(o.agents) == 0 {
		return errors.New("no -agent")
	}
	if o.rounds < 1 || o.calls < 1 || o.warmup < 0 || o.size < 1 || o.load < 0 || o.block < 0 {
		return errors.New("-rounds, -calls and -size must be positive, -warmup, -load and -block not negative")
	}
	switch o.only {
	case "":
		o.kinds = []string{callAllocate, callPreferred}
	case callAllocate, callPreferred:
		o.kinds = []string{o.only}
	default:
		return fmt.Errorf("-only %q: want %s or %s", o.only, callAllocate, callPreferred)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	load0 := loadAvg()

	var agents []*agentProc
	defer func() {
		for _, a := range agents {
			a.remove()
		}
	}()
	for _, spec := range o.agents {
		a, err := startAgent(ctx, spec, o)
		if err != nil {
			return fmt.Errorf("agent %s: %w", spec.label, err)
		}
		agents = append(agents, a)
	}
	ids := agents[0].target.ids
	if len(ids) < o.size {
		return fmt.Errorf("agent %s offers %d devices of %s, fewer than -size %d", agents[0].label, len(ids), o.resource, o.size)
	}

	bareDir, err := os.MkdirTemp("", "ao-bare-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(bareDir)
	bareSocket := filepath.Join(bareDir, "bare.sock")
	var bareCPU func() time.Duration
	barePID := 0
	if o.bareInProcess {
		p, err := startBarePlugin(bareSocket, ids)
		if err != nil {
			return fmt.Errorf("bare plugin: %w", err)
		}
		defer p.stop()
	} else {
		child, err := startBareChild(bareSocket, ids)
		if err != nil {
			return fmt.Errorf("bare plugin: %w", err)
		}
		defer stopProcess(child)
		bareCPU = func() time.Duration { d, _ := proc.CPUTime(child.Process.Pid); return d }
		barePID = child.Process.Pid
	}
	bare, err := dial(ctx, "bare", bareSocket, o)
	if err != nil {
		return fmt.Errorf("bare plugin: %w", err)
	}
	defer bare.close()
	bare.cpu = bareCPU
	if o.control {
		c, err := startControl(ctx, ids, o)
		if err != nil {
			return fmt.Errorf("-control: %w", err)
		}
		agents = append(agents, c)
	}

	var spinners []*exec.Cmd
	defer func() {
		for _, c := range spinners {
			stopProcess(c)
		}
	}()
	for range o.load {
		c, err := startSelf("-spin")
		if err != nil {
			return fmt.Errorf("-load: %w", err)
		}
		spinners = append(spinners, c)
	}

	var csvw *csv.Writer
	if o.csv != "" {
		f, err := os.Create(o.csv)
		if err != nil {
			return err
		}
		defer f.Close()
		csvw = csv.NewWriter(f)
		defer csvw.Flush()
		_ = csvw.Write([]string{"round", "agent", "call", "agent_p50_ns", "agent_p99_ns", "bare_p50_ns", "bare_p99_ns", "ratio"})
	}

	turns := "all of one's calls, then the other's"
	if o.block > 0 && o.block < o.calls {
		turns = fmt.Sprintf("taking turns every %d calls", o.block)
	}
	fmt.Printf("%d round(s) × %d calls (after %d warm-up) of %s per target, %s; %s on %s; bare plugin %s; %d busy loop(s); %d CPUs\n",
		o.rounds, o.calls, o.warmup, strings.Join(o.kinds, " and "), turns, o.resource, o.backend,
		map[bool]string{true: "in this process", false: "in a process of its own"}[o.bareInProcess], o.load, runtime.NumCPU())
	results := make([]map[string]*series, len(agents)) // per agent, per call
	for i := range results {
		results[i] = map[string]*series{}
		for _, call := range o.kinds {
			results[i][call] = &series{}
		}
	}
	stopPerf := func() {}
	if o.perf != "" {
		if stopPerf, err = startPerf(o.perf, agents, barePID); err != nil {
			return fmt.Errorf("-perf: %w", err)
		}
		defer stopPerf()
	}
	started := time.Now()
	for r := range o.rounds {
		for j := range agents {
			i := (j + r) % len(agents)
			a := agents[i]
			order := []*target{a.target, bare}
			if r%2 == 1 {
				order[0], order[1] = order[1], order[0]
			}
			for _, call := range o.kinds {
				got, err := measurePair(ctx, order, call, o)
				if err != nil {
					return fmt.Errorf("round %d, %s, %s: %w", r+1, a.label, call, err)
				}
				ag, br := got[a.target], got[bare]
				results[i][call].add(ag, br)
				if csvw != nil {
					_ = csvw.Write([]string{strconv.Itoa(r + 1), a.label, call,
						strconv.FormatInt(int64(ag.p50), 10), strconv.FormatInt(int64(ag.p99), 10),
						strconv.FormatInt(int64(br.p50), 10), strconv.FormatInt(int64(br.p99), 10),
						strconv.FormatFloat(float64(ag.p50)/float64(br.p50), 'f', 4, 64)})
				}
			}
		}
		fmt.Fprintf(os.Stderr, "round %d/%d done (%v)\n", r+1, o.rounds, time.Since(started).Round(time.Second))
	}
	load1 := loadAvg()
	stopPerf()
	for _, c := range spinners {
		stopProcess(c)
	}
	spinners = nil

	bareAlloc, barePref := bare.responseSizes(ctx)
	var facts []agentFacts
	for _, a := range agents {
		f := a.facts()
		a.stop()
		f.logSize = a.allocLogSize()
		if a.kubelet != nil {
			f.lists = a.kubelet.lists.Load()
		}
		facts = append(facts, f)
	}
	report(os.Stdout, o, agents, results, facts, bareAlloc, barePref, load0, load1)
	return nil
}

const (
	callAllocate  = "Allocate"
	callPreferred = "GetPreferredAllocation"
)

// segment is one run of calls to one target.
type segment struct {
	p50, p99 time.Duration
	calls    int
	cpu      time.Duration // the plugin process's CPU time during it, where known
}

// series is one agent's figures for one call, round by round.
type series struct {
	ratio                                []float64
	agentP50, agentP99, bareP50, bareP99 []float64 // µs
	agentCPU, bareCPU                    time.Duration
	calls                                int
}

func (s *series) add(ag, br segment) {
	s.ratio = append(s.ratio, float64(ag.p50)/float64(br.p50))
	s.agentP50 = append(s.agentP50, micros(ag.p50))
	s.agentP99 = append(s.agentP99, micros(ag.p99))
	s.bareP50 = append(s.bareP50, micros(br.p50))
	s.bareP99 = append(s.bareP99, micros(br.p99))
	s.agentCPU += ag.cpu
	s.bareCPU += br.cpu
	s.calls += ag.calls
}

// target is a device plugin socket the bench calls, with the kubelet's
// ListAndWatch stream open on it as the kubelet keeps it.
type target struct {
	name   string
	conn   *grpc.ClientConn
	client pluginapi.DevicePluginClient
	ids    []string
	cancel context.CancelFunc
	// The requests, built once: one Allocate per device, one
	// GetPreferredAllocation with every device available.
	alloc []*pluginapi.AllocateRequest
	pref  *pluginapi.PreferredAllocationRequest
	next  int // the device the next Allocate asks for, in turn
	lat   []time.Duration
	// cpu is the CPU time the plugin's process has used (nil: not known
	// apart from this one's).
	cpu func() time.Duration
}

// dial connects to a device plugin as the kubelet does and reads its
// devices from ListAndWatch's first answer; the stream stays open.
func dial(ctx context.Context, name, socket string, o options) (*target, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	t := &target{name: name, conn: conn, client: pluginapi.NewDevicePluginClient(conn)}
	sctx, cancel := context.WithCancel(context.Background())
	t.cancel = cancel
	stream, err := t.client.ListAndWatch(sctx, &pluginapi.Empty{})
	if err != nil {
		t.close()
		return nil, fmt.Errorf("ListAndWatch: %w", err)
	}
	first := make(chan error, 1)
	go func() {
		resp, err := stream.Recv()
		if err == nil {
			for _, d := range resp.GetDevices() {
				if d.GetHealth() != pluginapi.Healthy {
					err = fmt.Errorf("device %s is %s", d.GetID(), d.GetHealth())
					break
				}
				t.ids = append(t.ids, d.GetID())
			}
			if len(t.ids) == 0 && err == nil {
				err = errors.New("no devices")
			}
		}
		first <- err
		if err != nil {
			return
		}
		for {
			if _, err := stream.Recv(); err != nil {
				return
			}
		}
	}()
	select {
	case err = <-first:
	case <-time.After(30 * time.Second):
		err = errors.New("no ListAndWatch answer in 30s")
	case <-ctx.Done():
		err = ctx.Err()
	}
	if err != nil {
		t.close()
		return nil, fmt.Errorf("ListAndWatch: %w", err)
	}
	for _, id := range t.ids {
		t.alloc = append(t.alloc, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{id}}}})
	}
	t.pref = &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
		AvailableDeviceIDs: t.ids, AllocationSize: int32(o.size),
	}}}
	t.lat = make([]time.Duration, o.calls)
	return t, nil
}

func (t *target) close() {
	t.cancel()
	t.conn.Close()
}

// measurePair makes one kind of call to both targets of a pair, in order:
// -warmup calls that are not counted, then -calls timed ones, each target's
// in one run (-block 0) or taking turns in runs of -block calls.
func measurePair(ctx context.Context, order []*target, call string, o options) (map[*target]segment, error) {
	block := o.block
	if block <= 0 || block > o.calls {
		block = o.calls
	}
	cpu := map[*target]time.Duration{}
	if block == o.calls {
		for _, t := range order {
			if err := t.warm(ctx, call, o.warmup); err != nil {
				return nil, fmt.Errorf("%s: %w", t.name, err)
			}
			d, err := t.timed(ctx, call, t.lat)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", t.name, err)
			}
			cpu[t] = d
		}
	} else {
		for _, t := range order {
			if err := t.warm(ctx, call, o.warmup); err != nil {
				return nil, fmt.Errorf("%s: %w", t.name, err)
			}
		}
		for done := 0; done < o.calls; done += block {
			for _, t := range order {
				d, err := t.timed(ctx, call, t.lat[done:min(done+block, o.calls)])
				if err != nil {
					return nil, fmt.Errorf("%s: %w", t.name, err)
				}
				cpu[t] += d
			}
		}
	}
	out := map[*target]segment{}
	for _, t := range order {
		out[t] = segment{calls: len(t.lat), cpu: cpu[t], p50: percentile(t.lat, 0.50), p99: percentile(t.lat, 0.99)}
	}
	return out, nil
}

// one makes one call; Allocate asks for the next device in turn.
func (t *target) one(ctx context.Context, call string) error {
	var err error
	switch call {
	case callAllocate:
		_, err = t.client.Allocate(ctx, t.alloc[t.next%len(t.alloc)])
		t.next++
	default:
		_, err = t.client.GetPreferredAllocation(ctx, t.pref)
	}
	return err
}

// warm makes n calls, not timed.
func (t *target) warm(ctx context.Context, call string, n int) error {
	for range n {
		if err := t.one(ctx, call); err != nil {
			return err
		}
	}
	return nil
}

// timed makes len(lat) calls, one at a time, and records how long each
// took; it returns the CPU time the plugin's process used meanwhile (0
// where unknown).
func (t *target) timed(ctx context.Context, call string, lat []time.Duration) (time.Duration, error) {
	var cpu0 time.Duration
	if t.cpu != nil {
		cpu0 = t.cpu()
	}
	for i := range lat {
		start := time.Now()
		err := t.one(ctx, call)
		lat[i] = time.Since(start)
		if err != nil {
			return 0, err
		}
	}
	if t.cpu == nil {
		return 0, nil
	}
	return t.cpu() - cpu0, nil
}

// responseSizes is the encoded size of one Allocate and one
// GetPreferredAllocation answer, for the report.
func (t *target) responseSizes(ctx context.Context) (alloc, pref int) {
	if r, err := t.client.Allocate(ctx, t.alloc[0]); err == nil {
		alloc = proto.Size(r)
	}
	if r, err := t.client.GetPreferredAllocation(ctx, t.pref); err == nil {
		pref = proto.Size(r)
	}
	return alloc, pref
}

// agentProc is one `gpu-agent run` with its fake kubelet.
type agentProc struct {
	label, path, dir string
	noSimState       bool // the binary predates sim's state= option
	cmd              *exec.Cmd
	exited           chan struct{}
	kubelet          *fakeKubelet
	target           *target
	stopped          bool
}

// startAgent runs spec's binary until it has registered o.resource and
// answered ListAndWatch. A binary that refuses the sim backend's state=
// option (older than it) is started again without it.
func startAgent(ctx context.Context, spec agentSpec, o options) (*agentProc, error) {
	a, err := startAgentOnce(ctx, spec, o, false)
	if err != nil && strings.Contains(err.Error(), `unknown sim option "state=`) {
		a, err = startAgentOnce(ctx, spec, o, true)
	}
	return a, err
}

func startAgentOnce(ctx context.Context, spec agentSpec, o options, noSimState bool) (*agentProc, error) {
	// Unix socket paths are limited to 108 bytes: a short directory.
	dir, err := os.MkdirTemp("", "ao-")
	if err != nil {
		return nil, err
	}
	a := &agentProc{label: spec.label, path: spec.path, dir: dir, noSimState: noSimState, exited: make(chan struct{})}
	ok := false
	defer func() {
		if !ok {
			a.remove()
		}
	}()
	for _, d := range []string{"dp", "state", "mps"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	if a.kubelet, err = startFakeKubelet(filepath.Join(dir, "dp", "kubelet.sock"), filepath.Join(dir, "pr.sock")); err != nil {
		return nil, err
	}
	backend := o.backend
	if !noSimState && strings.HasPrefix(backend, "sim:") {
		backend += ",state=" + filepath.Join(dir, "sim.json")
	}
	logf, err := os.Create(filepath.Join(dir, "agent.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	// As the chart runs it: JSON logs at info, to a file here rather than
	// the container runtime's pipe.
	a.cmd = exec.Command(spec.path, "run", "--backend", backend,
		"--device-plugin-dir", filepath.Join(dir, "dp"), "--pod-resources-socket", filepath.Join(dir, "pr.sock"),
		"--state-dir", filepath.Join(dir, "state"), "--mps-root", filepath.Join(dir, "mps"),
		"--listen", "127.0.0.1:0", "--node-name", "n1", "--log-format", "json")
	a.cmd.Stdout, a.cmd.Stderr = logf, logf
	a.cmd.SysProcAttr = diesWithUs()
	if err := a.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { _ = a.cmd.Wait(); close(a.exited) }()

	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	go func() {
		select {
		case <-a.exited:
			cancel()
		case <-wctx.Done():
		}
	}()
	ep, err := a.kubelet.endpoint(wctx, o.resource)
	if err != nil {
		return nil, a.exitError(err)
	}
	if a.target, err = dial(wctx, spec.label, filepath.Join(dir, "dp", ep), o); err != nil {
		return nil, a.exitError(err)
	}
	a.target.cpu = a.cpu
	ok = true
	return a, nil
}

// exitError adds to err how the agent exited and the end of its log, if it
// did exit.
func (a *agentProc) exitError(err error) error {
	select {
	case <-a.exited:
		b, _ := os.ReadFile(filepath.Join(a.dir, "agent.log"))
		if len(b) > 2000 {
			b = b[len(b)-2000:]
		}
		return fmt.Errorf("%w; the agent exited (%v): %s", err, a.cmd.ProcessState, b)
	default:
		return err
	}
}

// cpu is the CPU time the agent has used (user and system, all threads).
func (a *agentProc) cpu() time.Duration {
	d, _ := proc.CPUTime(a.cmd.Process.Pid)
	return d
}

// stop ends the agent (SIGTERM, then SIGKILL after 20 s) and its fake
// kubelet; its directory stays until remove.
func (a *agentProc) stop() {
	if a.stopped {
		return
	}
	a.stopped = true
	if a.target != nil {
		a.target.close()
	}
	if a.cmd != nil && a.cmd.Process != nil {
		_ = a.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-a.exited:
		case <-time.After(20 * time.Second):
			_ = a.cmd.Process.Kill()
			<-a.exited
		}
	}
	if a.kubelet != nil {
		a.kubelet.stop()
	}
}

// remove stops the agent and removes its directory.
func (a *agentProc) remove() {
	a.stop()
	os.RemoveAll(a.dir)
}

// allocLogSize is the size of the agent's allocation log (-1: it has none).
func (a *agentProc) allocLogSize() int64 {
	fi, err := os.Stat(filepath.Join(a.dir, "state", "allocations.log"))
	if err != nil {
		return -1
	}
	return fi.Size()
}

// agentFacts is what the report says about each agent besides latency.
type agentFacts struct {
	grpc, kubelet, goVersion string
	allocSize, prefSize      int
	logSize                  int64
	lists                    int64
}

func (a *agentProc) facts() agentFacts {
	var f agentFacts
	if bi, err := buildinfo.ReadFile(a.path); err == nil {
		f.goVersion = bi.GoVersion
		for _, d := range bi.Deps {
			switch d.Path {
			case "google.golang.org/grpc":
				f.grpc = d.Version
			case "k8s.io/kubelet":
				f.kubelet = d.Version
			}
		}
	}
	f.allocSize, f.prefSize = a.target.responseSizes(context.Background())
	return f
}

// startSelf runs this command in a role.
func startSelf(args ...string) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	c := exec.Command(self, args...)
	c.Stderr = os.Stderr
	c.SysProcAttr = diesWithUs()
	return c, c.Start()
}

// startControl runs a second bare plugin in a process of its own, to be
// measured as an agent is.
func startControl(ctx context.Context, ids []string, o options) (*agentProc, error) {
	dir, err := os.MkdirTemp("", "ao-control-")
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	a := &agentProc{label: "control (bare)", path: self, dir: dir, exited: make(chan struct{})}
	socket := filepath.Join(dir, "bare.sock")
	if a.cmd, err = startBareChild(socket, ids); err != nil {
		a.remove()
		return nil, err
	}
	go func() { _ = a.cmd.Wait(); close(a.exited) }()
	if a.target, err = dial(ctx, a.label, socket, o); err != nil {
		a.remove()
		return nil, err
	}
	a.target.cpu = a.cpu
	return a, nil
}

// startBareChild runs the bare plugin in a child process and waits until
// it serves.
func startBareChild(socket string, ids []string) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	c := exec.Command(self, "-serve-bare", socket, "-bare-ids", strings.Join(ids, ","))
	c.Stderr = os.Stderr
	c.SysProcAttr = diesWithUs()
	out, err := c.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := c.Start(); err != nil {
		return nil, err
	}
	line := make([]byte, len("serving\n"))
	if _, err := io.ReadFull(out, line); err != nil {
		stopProcess(c)
		return nil, fmt.Errorf("the child did not start serving: %w", err)
	}
	return c, nil
}

// diesWithUs has a child killed when this command dies without cleaning
// up (SIGKILL): a busy loop left behind would skew whatever runs next.
func diesWithUs() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

func stopProcess(c *exec.Cmd) {
	_ = c.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = c.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = c.Process.Kill()
		<-done
	}
}

// loadAvg is the 1-minute load average ("?" where unknown).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return "?"
	}
	return f[0]
}
