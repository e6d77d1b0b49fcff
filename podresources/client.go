package podresources

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// Options tune a Client.
type Options struct {
	// Socket is the kubelet's pod-resources socket path (a relative one is
	// taken from the working directory).
	Socket string
	// MinInterval is the least time between two background List calls,
	// however often Invalidate is called (default 2s).
	MinInterval time.Duration
	// MaxAge refreshes the cache even without Invalidate, to see pods that
	// ended (default 30s).
	MaxAge time.Duration
	// Timeout bounds one List call (default 5s).
	Timeout time.Duration
	// Keep selects the resources attributed (nil: IsGPUResource).
	Keep func(resource string) bool
	// OnChange gets each background answer that differs from the last one
	// (not Refresh's: its caller has the answer). It must not block.
	OnChange func(*Attribution)
	Logger   *slog.Logger
}

// Client keeps an Attribution from the kubelet's pod-resources API
// fresh: one connection, a List after each Invalidate (rate limited) and
// every MaxAge. Scrapes read the cache; they never dial the kubelet. Run's
// goroutine is the only one that talks to the kubelet and writes the cache:
// Refresh hands it a request and waits for the answer.
type Client struct {
	opts     Options
	log      *slog.Logger
	cur      atomic.Pointer[Attribution]
	kick     chan struct{}
	requests chan chan refreshResult
	lists    atomic.Int64
}

type refreshResult struct {
	att *Attribution
	err error
}

// NewClient returns an attribution source; it lists nothing until Run.
func NewClient(opts Options) *Client {
	if opts.MinInterval <= 0 {
		opts.MinInterval = 2 * time.Second
	}
	if opts.MaxAge <= 0 {
		opts.MaxAge = 30 * time.Second
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Second
	}
	if opts.Keep == nil {
		opts.Keep = IsGPUResource
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if abs, err := filepath.Abs(opts.Socket); err == nil {
		// gRPC reads "unix://relative/path" as an authority and refuses it.
		opts.Socket = abs
	}
	p := &Client{opts: opts, log: opts.Logger, kick: make(chan struct{}, 1), requests: make(chan chan refreshResult)}
	p.cur.Store(NewAttribution(nil, nil))
	return p
}

// Refresh asks the kubelet now, bypassing the cache's rate limit, and
// returns the answer (also cached). It is for decisions that destroy what a
// pod may hold (MIG repartitioning), not for scrapes. It fails when Run is
// not running or the kubelet does not answer within Timeout.
func (p *Client) Refresh(ctx context.Context) (*Attribution, error) {
	ctx, cancel := context.WithTimeout(ctx, p.opts.Timeout+time.Second)
	defer cancel()
	reply := make(chan refreshResult, 1)
	select {
	case p.requests <- reply:
	case <-ctx.Done():
		return nil, fmt.Errorf("pod-resources %s: no answer: %w", p.opts.Socket, ctx.Err())
	}
	select {
	case r := <-reply:
		return r.att, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("pod-resources %s: no answer: %w", p.opts.Socket, ctx.Err())
	}
}

// Attribution returns the cached attribution; safe from any goroutine.
func (p *Client) Attribution() *Attribution { return p.cur.Load() }

// Invalidate asks for a refresh: call it after an Allocate, when the
// kubelet's answer is about to change.
func (p *Client) Invalidate() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Lists returns how many List calls were made (for tests and /status).
func (p *Client) Lists() int64 { return p.lists.Load() }

// Run refreshes the cache and answers Refresh until ctx is done.
func (p *Client) Run(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+p.opts.Socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)))
	if err != nil {
		return fmt.Errorf("pod-resources %s: %w", p.opts.Socket, err)
	}
	defer conn.Close()
	client := podresourcesv1.NewPodResourcesListerClient(conn)
	var lastErr string
	list := func() (*Attribution, error) {
		lctx, cancel := context.WithTimeout(ctx, p.opts.Timeout)
		defer cancel()
		resp, err := client.List(lctx, &podresourcesv1.ListPodResourcesRequest{})
		p.lists.Add(1)
		if err != nil {
			if msg := err.Error(); msg != lastErr && ctx.Err() == nil {
				// Keep the last answer: pods rarely all vanish, and metrics
				// without their pods are worse than slightly stale ones.
				p.log.Warn("pod-resources List failed; keeping the last attribution", "socket", p.opts.Socket, "error", err)
				lastErr = msg
			}
			return nil, fmt.Errorf("pod-resources %s: List: %w", p.opts.Socket, err)
		}
		if lastErr != "" {
			p.log.Info("pod-resources List works again", "socket", p.opts.Socket)
			lastErr = ""
		}
		a := NewAttribution(resp.GetPodResources(), p.opts.Keep)
		p.cur.Store(a)
		return a, nil
	}
	age := time.NewTimer(0)
	defer age.Stop()
	limit := time.NewTimer(0)
	defer limit.Stop()
	limited := false // an Invalidate waits in kick until limit fires
	for {
		kick := p.kick
		if limited {
			kick = nil
		}
		select {
		case <-ctx.Done():
			return nil
		case reply := <-p.requests:
			a, err := list()
			reply <- refreshResult{att: a, err: err}
			continue
		case <-limit.C:
			limited = false
			continue
		case <-kick:
		case <-age.C:
		}
		before := p.cur.Load()
		if a, err := list(); err == nil && p.opts.OnChange != nil && !a.Same(before) {
			p.opts.OnChange(a)
		}
		limited = true
		limit.Reset(p.opts.MinInterval)
		age.Reset(p.opts.MaxAge)
	}
}
