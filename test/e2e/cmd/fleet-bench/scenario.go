package main

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// namespace holds every scenario's pods and claims.
const namespace = "fleet"

// binaries are the control plane's, built by test/e2e/run.sh.
type binaries struct{ Etcd, APIServer, Scheduler string }

// result is one row of the table: one model, fleet size and claim.
type result struct {
	Model, Claim string
	Nodes        int
	Asked, Bound int
	// Rate is the median of the rounds' steady binding rates (see round); RateMin and RateMax bound them.
	// Wall and SchedCPU are the median round's.
	Rate, RateMin, RateMax float64
	Wall                   time.Duration
	// Rounds is how many rounds were measured: a row repeats its pods on the same scheduler, each round after
	// the last one's pods and claims are gone, and stops after a round that reaches the time limit.
	Rounds int
	// SchedStart is from the scheduler's start to its /readyz with the fleet already in the API server: its
	// informers' initial list of every Node and ResourceSlice.
	SchedStart time.Duration
	// SchedCPU is the scheduler's CPU time over the binding phase (pods' creation to the end).
	SchedCPU   time.Duration
	Sched, API memory // the scheduler's (a fresh process, over every round) and the API server's (peak reset before the first round's pods)
	// SchedHeap is the scheduler's live heap after the last round, in bytes, right after a collection (0:
	// not read): what it holds, whenever its collector last ran.
	SchedHeap      uint64
	APIPeakReset   bool  // whether the API server's peak could be reset (else it is the peak since its start)
	SliceBytes     int   // per node
	Stats          stats // per node
	TimedOut       bool
	Skip, Err, Why string // Why: the scheduler's last word on a pod it did not bind
}

// round is one pass of a row's pods: Rate is the steady binding rate (steadyRate: from the last pod's
// creation to the last binding), Wall runs from the first pod's creation to the last binding (or
// to the time limit), CPU is the scheduler's over that window.
type round struct {
	Bound    int
	Rate     float64
	Wall     time.Duration
	CPU      time.Duration
	TimedOut bool
	Why      string
}

// summarize sets r's figures from its rounds: the median round by rate (the lower middle one of an even
// count) gives the rate, wall and CPU, and a round that timed out gives the row its count and reason.
func (r *result) summarize(rounds []round) {
	r.Rounds = len(rounds)
	if len(rounds) == 0 {
		return
	}
	byRate := slices.Clone(rounds)
	slices.SortStableFunc(byRate, func(a, b round) int { return cmp.Compare(a.Rate, b.Rate) })
	mid := byRate[(len(byRate)-1)/2]
	r.Rate, r.RateMin, r.RateMax = mid.Rate, byRate[0].Rate, byRate[len(byRate)-1].Rate
	r.Wall, r.SchedCPU, r.Bound = mid.Wall, mid.CPU, mid.Bound
	if last := rounds[len(rounds)-1]; last.TimedOut {
		r.Rate, r.RateMin, r.RateMax = last.Rate, last.Rate, last.Rate
		r.Wall, r.SchedCPU, r.Bound, r.TimedOut, r.Why = last.Wall, last.CPU, last.Bound, true, last.Why
	}
}

// fleetRun is one control plane with N nodes of one model; its scenarios run one after another on it, each
// with a fresh scheduler.
type fleetRun struct {
	bins  binaries
	dir   string
	repo  string
	tmpl  template
	nodes int
	// others, when mixed > 0, is the template of every node but the first mixed ones, which get tmpl: a
	// fleet where only some nodes publish tmpl's model (MIG on demand on the nodes that serve MIG claims).
	others template
	mixed  int
	pods   int
	// rounds is how many times each row's pods are measured (at least 1).
	rounds int
	limit  time.Duration
	// cpuprofile: a directory for the scheduler's CPU profiles ("": none).
	cpuprofile string
	logf       func(string, ...any)
	apiServer  *harness.Process
}

// run starts the control plane, creates the fleet and measures every claim on it, returning a row per claim
// (skipped claims included, with the reason); an error is returned when the fleet itself cannot be made.
func (f *fleetRun) run(ctx context.Context, claims []claimSpec) ([]result, error) {
	cp, err := f.start(ctx)
	if cp != nil {
		defer func() {
			if err := cp.Stop(10 * time.Second); err != nil {
				f.logf("%v", err)
			}
		}()
	}
	if err != nil {
		return nil, err
	}
	cs, err := benchClient(cp.RESTConfig)
	if err != nil {
		return nil, err
	}
	st := f.tmpl.stats()
	sb, err := sliceBytes(ctx, cs, fleetNodeName(0))
	if err != nil {
		return nil, err
	}
	var out []result
	for _, c := range claims {
		r := result{Model: f.model(), Claim: c.Name, Nodes: f.nodes, Asked: f.pods, SliceBytes: sb, Stats: st}
		if ok, why := c.Fits(f.tmpl); !ok {
			r.Skip = why
			out = append(out, r)
			continue
		}
		f.logf("measuring %s, %d nodes, %d pods of claim %s (at most %s)", f.model(), f.nodes, f.pods, c.Name, f.limit)
		if err := f.measure(ctx, cp, cs, c, &r); err != nil {
			r.Err = err.Error()
			f.logf("%s/%d/%s: %v", r.Model, r.Nodes, r.Claim, err)
		}
		f.logf("%s", r.summary())
		out = append(out, r)
		if ctx.Err() != nil {
			return out, ctx.Err()
		}
	}
	return out, nil
}

// tmplOf is the template of node i.
func (f *fleetRun) tmplOf(i int) template {
	if f.mixed > 0 && i >= f.mixed {
		return f.others
	}
	return f.tmpl
}

// model is the row's name for the fleet's model: tmpl's, with the share of nodes that publish it when mixed.
func (f *fleetRun) model() string {
	if f.mixed > 0 {
		return fmt.Sprintf("%s on %d%% (rest %s)", f.tmpl.Model, (100*f.mixed+f.nodes/2)/f.nodes, f.others.Model)
	}
	return f.tmpl.Model
}

// start brings up etcd and the API server, creates the DeviceClasses, the namespace and the fleet. The
// scheduler is not started yet: each scenario starts its own.
func (f *fleetRun) start(ctx context.Context) (*harness.ControlPlane, error) {
	sctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	t0 := time.Now()
	cp, err := harness.StartControlPlane(sctx, harness.ControlPlaneConfig{
		APIServer: f.bins.APIServer, Etcd: f.bins.Etcd, Dir: f.dir, LogDir: filepath.Join(f.dir, "logs"),
		SchedulerClientQPS: 5000,
	})
	if err != nil {
		return nil, fmt.Errorf("control plane: %w", err)
	}
	f.apiServer = cp.APIServer
	cs, err := benchClient(cp.RESTConfig)
	if err != nil {
		return cp, err
	}
	if err := createDeviceClasses(ctx, cs, filepath.Join(f.repo, "deploy", "manifests", "dra", "deviceclasses.yaml")); err != nil {
		return cp, err
	}
	if err := createNamespace(ctx, cs, namespace); err != nil {
		return cp, err
	}
	t1 := time.Now()
	// Creating thousands of slices of tens of kB takes the API server a while on two cores; bounded all the
	// same, so that the program ends by itself.
	cctx, cancel := context.WithTimeout(ctx, 20*time.Minute)
	defer cancel()
	if err := createFleet(cctx, cs, f.nodes, f.tmplOf); err != nil {
		return cp, fmt.Errorf("%s: %d nodes: %w", f.model(), f.nodes, err)
	}
	f.logf("%s: control plane up in %s, %d nodes with %d slices each created in %s", f.model(),
		t1.Sub(t0).Round(100*time.Millisecond), f.nodes, len(f.tmpl.Slices), time.Since(t1).Round(100*time.Millisecond))
	return cp, nil
}

// benchClient is an admin client whose rate limit does not throttle the benchmark's own creations.
func benchClient(cfg *rest.Config) (kubernetes.Interface, error) {
	c := rest.CopyConfig(cfg)
	c.QPS, c.Burst = 5000, 5000
	c.Timeout = 2 * time.Minute // a list of every slice of 500 nodes is hundreds of MB
	cs, err := kubernetes.NewForConfig(c)
	if err != nil {
		return nil, fmt.Errorf("client: %w", err)
	}
	return cs, nil
}

// measure runs one scenario: a fresh scheduler, then f.rounds rounds of claims and pods on it, each waiting
// until every pod is bound or the limit passes, and the last cleared before the next.
func (f *fleetRun) measure(ctx context.Context, cp *harness.ControlPlane, cs kubernetes.Interface, c claimSpec, r *result) error {
	clearPods := func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Minute)
		defer cancel()
		if err := clearNamespace(cctx, cs, namespace); err != nil {
			f.logf("%v", err)
		}
	}
	defer func() {
		if err := cp.StopScheduler(10 * time.Second); err != nil {
			f.logf("%v", err)
		}
		clearPods()
	}()
	t0 := time.Now()
	sctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	if err := cp.StartScheduler(sctx, f.bins.Scheduler); err != nil {
		return err
	}
	if err := cp.WaitSchedulerReady(sctx); err != nil {
		return err
	}
	r.SchedStart = time.Since(t0)
	sched := cp.Scheduler.PID()
	if err := resetPeakRSS(f.apiServer.PID()); err != nil {
		f.logf("API server peak RSS not reset (it is the peak since its start): %v", err)
	} else {
		r.APIPeakReset = true
	}
	var rounds []round
	defer func() { r.summarize(rounds) }()
	for i := range max(1, f.rounds) {
		if i > 0 {
			clearPods()
		}
		// What the scheduler does once ready (its first resyncs), or after the last round's pods and claims
		// are gone, is not the pods' cost: wait until it idles.
		if err := waitIdle(ctx, sched); err != nil {
			return err
		}
		rd, err := f.round(ctx, cp, cs, c, i == 0)
		if err != nil {
			return err
		}
		rounds = append(rounds, rd)
		if f.rounds > 1 {
			f.logf("round %d: %d/%d bound, %.2f pods/s", i+1, rd.Bound, f.pods, rd.Rate)
		}
		if rd.TimedOut {
			break // a row at its limit is measured once: its next round would take as long
		}
	}
	var err error
	if r.Sched, err = readMemory(sched); err != nil {
		return fmt.Errorf("kube-scheduler memory: %w", err)
	}
	if r.API, err = readMemory(f.apiServer.PID()); err != nil {
		return fmt.Errorf("kube-apiserver memory: %w", err)
	}
	// Last: the collection it forces is not the pods' cost, nor does it lower the peak read above.
	var buf bytes.Buffer
	if err := cp.SchedulerHeapStats(ctx, &buf); err != nil {
		f.logf("%v", err)
	} else if r.SchedHeap, err = parseHeapAlloc(buf.Bytes()); err != nil {
		f.logf("kube-scheduler: %v", err)
	}
	return nil
}

// round creates the claims, then the pods, and times their binding by the running scheduler; profiled: the
// scheduler is profiled over it (when f.cpuprofile is set).
func (f *fleetRun) round(ctx context.Context, cp *harness.ControlPlane, cs kubernetes.Interface, c claimSpec, profiled bool) (round, error) {
	var rd round
	sched := cp.Scheduler.PID()
	// Claims first, so that a pod never waits for its claim and the creations are not in the measured window.
	pods := make([]*corev1.Pod, f.pods)
	err := parallel(ctx, f.pods, 16, func(ctx context.Context, i int) error {
		claim, pod := claimAndPod(namespace, c, i)
		pods[i] = pod
		if _, err := cs.ResourceV1().ResourceClaims(namespace).Create(ctx, claim, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create ResourceClaim %s: %w", claim.Name, err)
		}
		return nil
	})
	if err != nil {
		return rd, err
	}

	w := newBindWatch(cs)
	wctx, stopWatch := context.WithCancel(ctx)
	// The informer's goroutines end once its context does (stopWatch), and Shutdown waits for them.
	defer w.factory.Shutdown()
	defer stopWatch()
	if err := w.start(wctx); err != nil {
		return rd, err
	}
	cpu0, err := cpuTime(sched)
	if err != nil {
		return rd, fmt.Errorf("kube-scheduler CPU time: %w", err)
	}
	if profiled {
		done := f.profile(ctx, cp, c)
		defer func() { <-done }()
	}
	start := time.Now()
	deadline := start.Add(f.limit)
	err = parallel(ctx, f.pods, 16, func(ctx context.Context, i int) error {
		if _, err := cs.CoreV1().Pods(namespace).Create(ctx, pods[i], metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create Pod %s: %w", pods[i].Name, err)
		}
		return nil
	})
	if err != nil {
		return rd, err
	}
	// Creation competes with the scheduler for the API server and the CPUs, and while it lasts the scheduler
	// may wait for pods: the rate is taken from its end (steadyRate).
	created := time.Now()
	f.logf("%d pods created in %s, %d bound meanwhile", f.pods, duration(created.Sub(start)), w.count())
	for w.count() < f.pods && time.Now().Before(deadline) {
		if done, werr := cp.Scheduler.Exited(); done {
			return rd, fmt.Errorf("kube-scheduler exited: %v (see %s)", werr, cp.Scheduler.LogPath)
		}
		select {
		case <-ctx.Done():
			return rd, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	end := time.Now()
	cpu1, err := cpuTime(sched)
	if err != nil {
		return rd, fmt.Errorf("kube-scheduler CPU time: %w", err)
	}
	rd.CPU = cpu1 - cpu0
	times := w.times()
	rd.Bound = len(times)
	rd.TimedOut = rd.Bound < f.pods
	rd.Wall = end.Sub(start)
	if !rd.TimedOut && rd.Bound > 0 {
		rd.Wall = times[len(times)-1].Sub(start)
	}
	rd.Rate = steadyRate(times, created)
	if rd.TimedOut {
		rd.Why = w.whyPending(ctx, cs)
	}
	return rd, nil
}

// profile takes a CPU profile of the scheduler over the binding phase (at most 30 s), then a heap profile,
// into the cpuprofile directory, when there is one; the channel closes when both are written.
func (f *fleetRun) profile(ctx context.Context, cp *harness.ControlPlane, c claimSpec) <-chan struct{} {
	done := make(chan struct{})
	if f.cpuprofile == "" {
		close(done)
		return done
	}
	name := filepath.Join(f.cpuprofile, strings.NewReplacer(" ", "_", "%", "pct", "(", "", ")", "").Replace(
		fmt.Sprintf("%s-%d-%s.pprof", f.model(), f.nodes, c.Name)))
	go func() {
		defer close(done)
		var buf bytes.Buffer
		err := cp.SchedulerCPUProfile(ctx, min(f.limit, 30*time.Second), &buf)
		if err == nil {
			err = os.WriteFile(name, buf.Bytes(), 0o644)
		}
		if err != nil {
			f.logf("%v", err)
		}
		// And what it holds then: the fleet's slices, in the forms the scheduler keeps them.
		buf.Reset()
		if err = cp.SchedulerHeapProfile(ctx, &buf); err == nil {
			err = os.WriteFile(strings.TrimSuffix(name, ".pprof")+".heap.pprof", buf.Bytes(), 0o644)
		}
		if err != nil {
			f.logf("%v", err)
		}
	}()
	return done
}

// steadyRate is the scheduler's own pace: the bindings after created (when every pod existed) over the time
// from then to the last. Before that the pods' creation competes with the scheduler for the API server and the
// two CPUs, and a fast scheduler waits for pods: on 2 cores whole GPUs' 100 pods took about 200 ms to create,
// a third of their binding. Where fewer than minSteady pods were left to bind after it, the rate is from the
// first binding to the last (the scheduler kept up with the creations, so that is what it measures).
func steadyRate(times []time.Time, created time.Time) float64 {
	const minSteady = 10
	var after int
	for _, t := range times {
		if t.After(created) {
			after++
		}
	}
	if after >= minSteady {
		if d := times[len(times)-1].Sub(created).Seconds(); d > 0 {
			return float64(after) / d
		}
	}
	if len(times) < 2 {
		return 0
	}
	d := times[len(times)-1].Sub(times[0]).Seconds()
	if d <= 0 {
		return 0
	}
	return float64(len(times)-1) / d
}

// waitIdle waits until the process uses less than a tenth of a core over a second, for at most a minute
// (then it goes on: a busy scheduler is measured as it is).
func waitIdle(ctx context.Context, pid int) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	prev, err := cpuTime(pid)
	if err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
		now, err := cpuTime(pid)
		if err != nil {
			return err
		}
		if now-prev < 100*time.Millisecond {
			return nil
		}
		prev = now
	}
}

// bindWatch records when each pod of the namespace is first seen bound (spec.nodeName set), through an
// informer, which lists again should its watch break.
type bindWatch struct {
	factory informers.SharedInformerFactory
	mu      sync.Mutex
	bound   map[string]time.Time
}

func newBindWatch(cs kubernetes.Interface) *bindWatch {
	return &bindWatch{
		factory: informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(namespace)),
		bound:   map[string]time.Time{},
	}
}

func (w *bindWatch) start(ctx context.Context) error {
	inf := w.factory.Core().V1().Pods().Informer()
	see := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		if !ok || p.Spec.NodeName == "" {
			return
		}
		now := time.Now()
		w.mu.Lock()
		if _, seen := w.bound[p.Name]; !seen {
			w.bound[p.Name] = now
		}
		w.mu.Unlock()
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    see,
		UpdateFunc: func(_, obj any) { see(obj) },
	}); err != nil {
		return fmt.Errorf("pod informer: %w", err)
	}
	w.factory.Start(ctx.Done())
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for typ, ok := range w.factory.WaitForCacheSync(sctx.Done()) {
		if !ok {
			return fmt.Errorf("pod informer %v: not synced in a minute", typ)
		}
	}
	return nil
}

func (w *bindWatch) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.bound)
}

// times are the binding times, in order.
func (w *bindWatch) times() []time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	var ts []time.Time
	for _, t := range w.bound {
		ts = append(ts, t)
	}
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	return ts
}

// whyPending is the scheduler's message on one pod it did not bind (its PodScheduled condition), or what
// says it has not looked at it yet.
func (w *bindWatch) whyPending(ctx context.Context, cs kubernetes.Interface) string {
	pods, err := cs.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return "list pods: " + err.Error()
	}
	unbound, unseen := 0, 0
	var msg string
	for _, p := range pods.Items {
		if p.Spec.NodeName != "" {
			continue
		}
		unbound++
		seen := false
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
				seen = true
				if msg == "" {
					msg = fmt.Sprintf("%s: %s: %s", p.Name, c.Reason, c.Message)
				}
			}
		}
		if !seen {
			unseen++
		}
	}
	s := fmt.Sprintf("%d pods unbound, %d of them not yet tried (no PodScheduled=False)", unbound, unseen)
	if msg != "" {
		s += "; " + strings.TrimSpace(msg)
	}
	return s
}

// summary is a one-line log of a result.
func (r result) summary() string {
	if r.Err != "" {
		return fmt.Sprintf("%s/%d nodes/%s: error: %s", r.Model, r.Nodes, r.Claim, r.Err)
	}
	s := fmt.Sprintf("%s/%d nodes/%s: %d/%d bound, %.2f pods/s (median of %d rounds), scheduler ready in %s, CPU %s, RSS peak %d MiB, API server RSS peak %d MiB",
		r.Model, r.Nodes, r.Claim, r.Bound, r.Asked, r.Rate, r.Rounds, r.SchedStart.Round(100*time.Millisecond), r.SchedCPU,
		r.Sched.HWM>>20, r.API.HWM>>20)
	if r.Why != "" {
		s += "; " + r.Why
	}
	return s
}
