"""The words a guesser tries first, most likely first: the bases of the most common passwords,
then common English words, names, places and things (`paramsync.runtime.protocol.secret_strength`
rates a word by its rank here). Lowercase ASCII, no digits: the estimator strips case, common
substitutions and affixes before it looks a word up."""

from __future__ import annotations

__all__ = ["COMMON_WORDS"]

_TEXT = """
password qwerty letmein welcome monkey dragon master sunshine princess football baseball
shadow superman iloveyou trustno admin login abc secret default guest root user
test pass paramsync hello freedom whatever michael jordan jennifer hunter killer soccer
batman starwars charlie donald ashley bailey access mustang buster thomas tigger robert
hockey ranger daniel hannah maggie jessica pepper ginger summer winter spring autumn fall
love lovely angel baby flower purple orange yellow silver golden diamond computer internet
cookie cheese chocolate coffee banana apple orange pokemon naruto matrix ninja pirate
yankees lakers cowboys eagles steelers packers liverpool chelsea arsenal barcelona madrid
harley corvette ferrari porsche mercedes toyota honda jesus christ god heaven angel devil
samsung google facebook twitter linkedin microsoft windows linux ubuntu apple iphone android
company team office work project server cluster training model data cloud deploy prod
production staging develop developer dev system network security private public changeme
temp temporary sample example demo qazwsx zaq asdf zxcv hello world
the be to of and a in that have it for not on with he as you do at this but his by from
they we say her she or an will my one all would there their what so up out if about who
get which go me when make can like time no just him know take people into year your good
some could them see other than then now look only come its over think also back after use
two how our way even new want because any these give day most us is are was were been has
had did does said very much more many such long great little own old big high different
small large next early young important few bad same able last right left free strong
life home house family friend friends mother father brother sister child children man
woman men women boy girl king queen prince lord lady sir mister miss doctor teacher student
school college university class book story game games play player music song dance party
money cash bank gold star stars sun moon sky earth fire water ice snow rain storm wind
light dark night day morning evening happy lucky magic power super hero legend dream dreams
heart soul mind body blood life death dead live alive kill war peace time space rocket
red blue green black white pink brown grey gray
one two three four five six seven eight nine ten zero hundred thousand million
monday tuesday wednesday thursday friday saturday sunday weekend holiday christmas easter
january february march april may june july august september october november december
dog cat horse tiger lion bear wolf fox eagle hawk falcon shark dolphin whale snake dragon
fish bird mouse rabbit monkey panda turtle spider butterfly pony puppy kitty kitten
car truck bike train plane boat ship road street city town country world state nation
america usa canada england london paris berlin tokyo china india russia texas california
florida york boston chicago seattle austin denver vegas miami dallas houston phoenix
john james david william richard joseph charles chris christopher matthew anthony mark
paul steven andrew kenneth joshua kevin brian george edward ronald timothy jason jeffrey
ryan jacob gary nicholas eric stephen jonathan larry justin scott brandon frank benjamin
gregory samuel raymond patrick alexander jack dennis jerry tyler aaron jose henry adam
peter nathan zachary kyle walter harold carl arthur gerald roger keith jeremy terry lawrence
sean christian austin jesse dylan ethan noah logan lucas mason liam oliver elijah aiden
mary patricia linda barbara elizabeth susan margaret dorothy lisa nancy karen betty helen
sandra donna carol ruth sharon michelle laura sarah kimberly deborah amanda melissa
stephanie rebecca emily emma olivia sophia isabella mia abigail madison chloe ella grace
anna nicole samantha katherine christine rachel heather amber megan andrea julia maria
alex sam max ben tom tim joe dan mike nick matt steve bob bill jim tony kate jane amy
secure secret security safe lock key keys code codes cipher crypto hash token private
account accounts access admin administrator manager support service services info help
system systems config setup install update upgrade backup restore reset change start stop
open close enter exit login logout sign signin signup register member members
hello hi hey yes ok okay please thanks thank sorry welcome goodbye bye
computer laptop desktop phone mobile tablet keyboard mouse screen monitor printer
pizza burger pasta sushi taco beer wine vodka whiskey tequila coke pepsi sugar honey
candy cake pie bread butter milk tea juice water salt pepper spice
flower rose lily daisy tulip tree forest garden river lake ocean sea beach island mountain
hill valley desert field park stone rock metal iron steel wood glass paper
wonder wonderful beautiful pretty cute sweet hot cool cold warm nice fun funny crazy wild
happy sad angry mad best better worst fast slow quick easy hard simple smart clever
""".split()

COMMON_WORDS: tuple[str, ...] = tuple(dict.fromkeys(_TEXT))
"""Every word once, in the order a guesser tries them."""
